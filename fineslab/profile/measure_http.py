"""`python -m fineslab.profile measure --via http`: a profile measured through the full stack.

The in-process profile (`measure.py`, `<model>--<precision>--<device>.json`) times the engine's
steps alone; a client of a served model also pays for HTTP, the router, tokenization,
detokenization and the engine's per-request work. This profiler starts the one-model fleet of
`fineslab.profile.one_model` (launcher, plugin in a CPU arena, router; the fleet the fidelity
check serves) or takes `url` of a running endpoint, probes it with
`fineslab.profile.http_probe` (`repeats` rounds of probes) and writes
`<out_dir>/<model>--<precision>--<device>-http.json`:

    prefill_s(n)      a line fitted to the median TTFTs of lone n-token requests (16, 64, 128,
                      256 tokens), 9 rounds
    decode(b, c)      median TPOT of b concurrent requests (b = 1, 4, 8), the same for every
                      context c (the probes' contexts are 16-32 tokens; at these sizes a step
                      does not grow measurably with the context)
    rest              as `measure.py`: shape and KV bytes from the checkpoint, activations by
                      the roofline formula

The file's `device` stays the device kind ("cpu") so that the placer can use it; the `-http`
suffix of the file name and the provenance's `measured_via` say how it was measured, and the
launcher's default lookup (`<model>--<precision>--<device>.json`) never picks it up by itself.
The provenance records the command, the date, the endpoint and the load average before and
after the probes. Cost: the fleet's start (20-90 s on 2 shared cores) and about 20 s of probes.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
from dataclasses import replace
from pathlib import Path

from fineslab.loadgen.client import ClientConfig
from fineslab.loadgen.run import BenchConfig, run_benchmark
from fineslab.models.checkpoint import read_shape, safetensors_bytes_and_params
from fineslab.models.generate import ensure_model
from fineslab.profile.http_probe import DECODE_BATCHES, PREFILL_TOKENS, load_average, probe_tables
from fineslab.profile.measure import (
    MeasureConfig,
    base_provenance,
    build_profile,
)
from fineslab.profile.one_model import FLEET_DESCRIPTION, FleetSpec, serve_one_model
from fineslab.scheduler.kv_format import kv_token_bytes
from fineslab.scheduler.profile_schema import ModelProfile, profile_name, profile_to_dict
from fineslab.workload import Request

logger = logging.getLogger(__name__)

HTTP_SUFFIX = "-http"


def http_profile_path(directory: Path, model: str, precision: str, device: str) -> Path:
    """Where the HTTP-measured profile of `model` lives (beside the in-process one)."""
    return directory / f"{profile_name(model, precision, device)}{HTTP_SUFFIX}.json"


def save_http_profile(profile: ModelProfile, directory: Path) -> Path:
    """Write the profile under its `-http` name (the format of `save_profile`)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = http_profile_path(directory, profile.model, profile.precision, profile.device)
    path.write_text(json.dumps(profile_to_dict(profile), indent=1, sort_keys=True) + "\n")
    return path


def fleet_spec(config: MeasureConfig, model_dir: Path) -> FleetSpec:
    """The fleet that serves `config.model` for the probes (and for the fidelity check)."""
    shape, kv_dtype = read_shape(model_dir)
    token_bytes = kv_token_bytes(shape.num_layers, shape.num_kv_heads, shape.head_dim, kv_dtype)
    return FleetSpec(model_dir, config.model, kv_dtype, kv_dtype, config.chunk_tokens,
                     config.max_total_tokens, token_bytes)


def run_measure_http(config: MeasureConfig, url: str | None = None,
                     served_name: str | None = None) -> Path:
    """Probe `url` (default: a fleet started here) and write the `-http` profile."""
    model_dir = ensure_model(config.model, config.cache_dir)
    shape, kv_dtype = read_shape(model_dir)
    weights_bytes, num_params = safetensors_bytes_and_params(model_dir)
    shape = replace(shape, num_params=num_params)
    prefill_tokens = PREFILL_TOKENS[:2] if config.quick else PREFILL_TOKENS
    batch_sizes = DECODE_BATCHES[:2] if config.quick else DECODE_BATCHES
    with contextlib.ExitStack() as stack:
        endpoint = url or stack.enter_context(serve_one_model(fleet_spec(config, model_dir)))
        bench = BenchConfig(ClientConfig(endpoint),
                            served_names={config.model: served_name or config.model},
                            tokenizer=model_dir, progress=False, seed=config.seed)
        # Warm-up: the first requests pay for lazy initialisation in every process.
        run_benchmark(bench, [Request("probe-warmup", config.model, 0.0, 16, 2)])
        before = load_average()
        tables = probe_tables(bench, config.model, config.repeats, prefill_tokens, batch_sizes)
        after = load_average()
    decode = tuple(tuple(s for _ in config.context_tokens) for s in tables.decode_steps)
    command = (f"python -m fineslab.profile measure --model {config.model} --via http"
               + (f" --url {url}" if url else "") + (" --quick" if config.quick else ""))
    provenance = {
        **base_provenance(command, _sglang_version()),
        "measured_via": "http: " + (url or FLEET_DESCRIPTION.format(chunk=config.chunk_tokens)),
        "probes": f"fineslab.profile.http_probe, {config.repeats} rounds, medians, prefill "
                  "a fitted line (after one warm-up request)",
        "load_average": f"{before:.2f} before, {after:.2f} after the probes (1-minute)",
        "raw_timings": tables.raw}
    profile = build_profile(config, shape, kv_dtype, weights_bytes,
                            {"prefill": list(tables.prefill), "decode": decode},
                            tables.batch_sizes, provenance)
    return save_http_profile(profile, config.out_dir)


def _sglang_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "?"
