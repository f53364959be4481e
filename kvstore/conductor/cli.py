"""``kvstore conductor``: the request scheduler in front of a fleet of vLLM engines.

Wiring only: flags → :class:`~kvstore.conductor.service.ConductorConfig` → the aiohttp
app of :mod:`kvstore.conductor.front`, served until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from kvstore.errors import InvalidArgument

if TYPE_CHECKING:
    from kvstore.conductor.service import ConductorConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8100, help="port to serve on (default 8100)")
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="URL[=ROLE]",
        help="a vLLM server (http://host:port), role both (default), prefill or decode; repeat for each. "
        "Engines the connector registers in --etcd join by themselves",
    )
    p.add_argument(
        "--etcd",
        default="",
        metavar="etcd://HOST:PORT/CLUSTER",
        help="the kvstore cluster: engines registered there (connector setting advertise_url) and the pool's chunks",
    )
    p.add_argument(
        "--pd", action="store_true", help="prefill/decode: prefill on a prefill engine, decode on a decode engine"
    )
    p.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=0.0,
        help="refuse (429) requests whose best estimated TTFT misses this (0: off)",
    )
    p.add_argument(
        "--slo-tbt-ms",
        type=float,
        default=0.0,
        help="refuse requests no engine can decode within this TBT (0: off); with it set, a request also goes "
        "where it costs the fewest requests their targets (its prefill stalls the engine's decodes)",
    )
    p.add_argument(
        "--no-reject",
        action="store_true",
        help="never refuse: the SLO targets only guide where requests go",
    )
    p.add_argument(
        "--min-samples", type=int, default=8, help="measurements before the model may refuse requests (default 8)"
    )
    p.add_argument(
        "--tokenizer",
        default="",
        help="tokenizer (HF id or path) for text prompts and chat templates; token-id prompts need none",
    )
    p.add_argument("--probe-s", type=float, default=1.0, help="engine health and /metrics probe period (default 1 s)")
    p.add_argument(
        "--pool-timeout-ms",
        type=float,
        default=50.0,
        help="most a request waits for its pool lookup (it is on every request's path) before it is routed "
        "without the pool; the lookup is not cancelled, nor counted an error (default 50)",
    )
    p.add_argument(
        "--prefill-tokens-per-s", type=float, default=2000.0, help="prior prefill rate before any measurement"
    )
    p.add_argument(
        "--tier-gbps",
        default="10,2,1",
        metavar="DRAM,NVME,REMOTE",
        help="prior load rates in GB/s (`kvstore bench connector` measures them; default 10,2,1)",
    )
    p.add_argument("--bytes-per-token", type=int, default=128 << 10, help="KV bytes per token for the prior load rates")
    p.add_argument("--max-request-mb", type=float, default=32.0, help="largest request body accepted (default 32 MiB)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def config_from(a: argparse.Namespace) -> ConductorConfig:
    from kvstore.conductor.cost import Priors
    from kvstore.conductor.engines import parse_engine
    from kvstore.conductor.policy import Slo
    from kvstore.conductor.service import ConductorConfig

    engines = tuple(parse_engine(s) for s in a.engine)
    if not engines and not a.etcd:
        raise InvalidArgument(
            "give --engine URL[=ROLE] (one or more), or --etcd to find the engines the connector registers"
        )
    if a.etcd:
        from kvstore.cluster.state import parse_target

        parse_target(a.etcd)
    try:
        gbps = tuple(float(x) for x in a.tier_gbps.split(","))
    except ValueError:
        gbps = ()
    if len(gbps) != 3 or min(gbps) <= 0:
        raise InvalidArgument(f"--tier-gbps wants three positive numbers DRAM,NVME,REMOTE, got {a.tier_gbps!r}")
    for name in ("slo_ttft_ms", "slo_tbt_ms", "pool_timeout_ms", "probe_s", "prefill_tokens_per_s", "max_request_mb"):
        if getattr(a, name) < 0 or (
            name in ("probe_s", "prefill_tokens_per_s", "pool_timeout_ms") and getattr(a, name) == 0
        ):
            raise InvalidArgument(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    return ConductorConfig(
        engines=engines,
        etcd=a.etcd,
        pd=a.pd,
        slo=Slo(
            ttft_s=a.slo_ttft_ms / 1e3, tbt_s=a.slo_tbt_ms / 1e3, min_samples=a.min_samples, reject=not a.no_reject
        ),
        priors=Priors(prefill_tokens_per_s=a.prefill_tokens_per_s, load_gbps=gbps, bytes_per_token=a.bytes_per_token),
        probe_s=a.probe_s,
        pool_timeout_s=a.pool_timeout_ms / 1e3,
        tokenizer=a.tokenizer,
        max_body_bytes=int(a.max_request_mb * (1 << 20)),
    )


def main(a: argparse.Namespace) -> int:
    from aiohttp import web

    from kvstore.conductor.front import make_app
    from kvstore.conductor.service import Conductor

    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    try:
        cfg = config_from(a)
    except InvalidArgument as e:
        print(f"kvstore conductor: {e}")
        return 2
    app = make_app(Conductor(cfg))
    print(
        f"kvstore conductor on http://{a.host}:{a.port} (engines: {len(cfg.engines)} listed{', etcd ' + cfg.etcd if cfg.etcd else ''})",
        flush=True,
    )
    web.run_app(app, host=a.host, port=a.port, print=None, access_log=None)
    return 0
