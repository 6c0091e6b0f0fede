"""WeightStager: staging into a reused area, commit by storage swap (bound) or by copy (views only)."""

from __future__ import annotations

import pytest
import torch

from miles.core.errors import EngineError
from miles.models.hf_io import hf_param_views, hf_tensor_views
from miles.weightsync.stager import WeightStager

from .sync_helpers import trainer_model


def _bound(model: torch.nn.Module) -> WeightStager:
    st = WeightStager(hf_tensor_views(model))  # type: ignore[arg-type]
    assert st.bind_model(model, lambda n, t: hf_param_views(model.spec, n, t))  # type: ignore[operator]
    return st


@pytest.mark.parametrize("bind", [True, False])
def test_versions_install_whole_and_staging_is_reused(bind: bool) -> None:
    model, src = trainer_model(seed=1), trainer_model(seed=2)
    st = _bound(model) if bind else WeightStager(hf_tensor_views(model))
    assert st.swaps == bind
    slots_seen = []
    for version, seed in ((1, 2), (2, 3), (3, 4)):
        src = trainer_model(seed=seed)
        want = {k: v.clone() for k, v in hf_tensor_views(src).items()}
        before = {k: v.clone() for k, v in hf_tensor_views(model).items()}
        names = list(want)
        st.stage(version, [(n, want[n]) for n in names[: len(names) // 2]])
        st.stage(version, [(n, want[n]) for n in names[len(names) // 2:]])
        # staged, not committed: the live model is untouched
        assert all(torch.equal(v, before[k]) for k, v in hf_tensor_views(model).items())
        st.check_complete(version)
        st.apply()
        assert all(torch.equal(v, want[k]) for k, v in hf_tensor_views(model).items())
        slots_seen.append(st.slot(names[0]).data_ptr())
    # allocated once: with swapping the two sets alternate, with copying one arena stays
    assert len(set(slots_seen)) == (2 if bind else 1)


def test_aborted_version_leaves_the_model_and_a_partial_stage_is_refused() -> None:
    model = trainer_model(seed=1)
    st = _bound(model)
    before = {k: v.clone() for k, v in hf_tensor_views(model).items()}
    src = hf_tensor_views(trainer_model(seed=5))
    st.stage(7, list(src.items())[:3])
    with pytest.raises(EngineError, match="not staged"):
        st.check_complete(7)
    with pytest.raises(EngineError, match="older version than the staged 7"):
        st.stage(6, list(src.items())[:1])  # a late bucket of an abandoned sync
    st.stage(8, list(src.items())[:1])  # a newer version drops the abandoned 7
    with pytest.raises(EngineError, match="nothing staged for it"):
        st.check_complete(7)
    st.drop()
    assert all(torch.equal(v, before[k]) for k, v in hf_tensor_views(model).items())
    with pytest.raises(EngineError, match="shape"):
        st.stage(9, [(next(iter(src)), torch.zeros(3))])


def test_a_receiver_may_write_straight_into_the_slot() -> None:
    model = trainer_model(seed=1)
    st = _bound(model)
    src = hf_tensor_views(trainer_model(seed=6))
    for n, t in src.items():
        st.slot(n).copy_(t)
        st.stage(1, [(n, st.slot(n))])
    st.check_complete(1)
    st.apply()
    assert all(torch.equal(v, src[k]) for k, v in hf_tensor_views(model).items())


def test_views_that_miss_bytes_of_a_parameter_decline_swapping() -> None:
    model = trainer_model(seed=1)
    st = WeightStager(hf_tensor_views(model))
    # a view function that forgets part of every parameter: a swap would resurrect stale bytes
    assert not st.bind_model(model, lambda n, t: [(k, v[:1]) for k, v in hf_param_views(model.spec, n, t)])
    assert not st.swaps
