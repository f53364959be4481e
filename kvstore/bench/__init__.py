"""`kvstore bench`: throughput, latency, index-scale and TLS benchmarks, every figure reported as a
ratio against a reference measured in the same run (`refs`: memcpy, raw socket, disk, Redis)."""
