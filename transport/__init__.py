"""Transport: the wire codec, ZeroMQ socket helpers and bulk channels. Imports only core."""
