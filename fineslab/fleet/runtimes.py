"""SGLang runtimes of a fleet: their command lines, one way for every precision.

`server_spec(plan, prepared)` turns a `RuntimePlan` and its model's prepared checkpoint
(`fineslab.quant.serving.PrecisionRuntime`) into the SGLang server: the served name is the
model's name in the fleet (the OpenAI `model` field), the page size is the arena block's
tokens, the precision's arguments (`--dtype`, `--quantization`, `--kv-cache-dtype`, ...) come
from the prepared checkpoint, and the plugin's join goes to the runtime as its
contract (`FINESLAB_CONTRACT`: the arena, runtime id, key pool, weights and streaming flags, the
quantized KV format and the planned block, fineslab.slabs.contract; `FINESLAB_ARENA` and
`FINESLAB_RUNTIME_ID` too, which mark its processes), the engine schedule (`FINESLAB_ENGINE_POLICY`,
with `local_scheduler: engine`) and the model's `env`. This is the one way
fineslab starts a runtime of any precision.

The supervision of the processes started from these specs is in `supervisor.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from fineslab.env import ARENA_VAR, CACHE_SQUEEZE_VAR, CONTRACT_VAR, RUNTIME_ID_VAR, FineslabEnv
from fineslab.errors import EnvironmentSetupError
from fineslab.fleet.config import flag_value
from fineslab.fleet.plan import RuntimePlan, prefill_chunk_args
from fineslab.proctree import FLEET_MARKER
from fineslab.quant.serving import PrecisionRuntime
from fineslab.router.routes import TokenBudget
from fineslab.runtime import ServerSpec, free_port
from fineslab.sglang_plugin import ArenaJoin
from fineslab.sglang_plugin.config import LENT_RADIX_BACKEND, EngineSchedule
from fineslab.slabs.formats import BlockFormat

logger = logging.getLogger(__name__)

#: KV tokens for a runtime on SGLang's own pool (no arena to size it): enough for the demo.
OWN_POOL_MAX_TOTAL_TOKENS = 16384


def token_budget(plan: RuntimePlan, use_arena: bool) -> TokenBudget | None:
    """The KV token budget `server_spec` gives the runtime (`--max-total-tokens`: the model's
    `extra_args`, else the own pool's default), for the router to refuse what it cannot hold;
    None in the arena without one (the arena's capacity, far above a request). SGLang's own
    pool at its default page size (1; some GPU attention backends page more, which the router's
    check then slightly underestimates)."""
    given = flag_value(plan.model.extra_args, "--max-total-tokens")  # checked by the config
    tokens = int(given) if given is not None else None if use_arena else OWN_POOL_MAX_TOTAL_TOKENS
    if tokens is None:
        return None
    return TokenBudget(tokens, (plan.page_size or 1) if use_arena else 1)


#: The compute threads variable each CPU runtime is given (torch reads it at import).
THREADS_VAR = "OMP_NUM_THREADS"


def cpu_threads_env(runtimes: Sequence[RuntimePlan], environ: Mapping[str, str],
                    cores: int | None) -> dict[str, str]:
    """What every runtime of a node's fleet gets alike: on CPU, its share of the node's cores
    as `OMP_NUM_THREADS` (at least 1). torch's default is every core for each runtime: four
    runtimes on two cores then ran eight spinning compute threads, and a test module of two
    fleets took 20% longer than with one thread each. Nothing where the launcher's own
    environment sets the variable (the operator's choice; a model's `env` overrides both) or
    where no runtime is on a CPU."""
    on_cpu = sum(1 for r in runtimes if r.device.is_cpu)
    if not on_cpu or THREADS_VAR in environ:
        return {}
    return {THREADS_VAR: str(max(1, (cores or 1) // on_cpu))}


def server_spec(plan: RuntimePlan, prepared: PrecisionRuntime, fleet_id: str, use_arena: bool,
                port: int | None = None, max_running_requests: int | None = None,
                schedule: EngineSchedule | None = None, contract_dir: Path | None = None,
                planned: BlockFormat | None = None, files: Mapping[str, str] | None = None,
                base_env: Mapping[str, str] | None = None) -> ServerSpec:
    """The SGLang server for one runtime of the plan (see the module docstring); `schedule`:
    the local scheduler inside the runtime (`local_scheduler: engine`). With `contract_dir`, the
    join goes to the runtime as its contract (`<contract_dir>/<runtime id>.contract.json`,
    fineslab.slabs.contract), with `planned`, the block the plan gives it, which the plugin
    checks at join, and `files`, the control files it shares with the launcher by purpose."""
    model = plan.model
    args = ["--served-model-name", model.name, *prepared.server_args]
    if prepared.kv_env and not use_arena:
        raise EnvironmentSetupError(f"runtime {plan.runtime_id}: {prepared.kv_dtype.value} KV "
                                    "is stored only in the slab arena (kv_pool: arena)")
    if use_arena:
        if plan.page_size is None:
            raise EnvironmentSetupError(f"runtime {plan.runtime_id}: no arena page size planned")
        args += ["--page-size", str(plan.page_size),
                 *prefill_chunk_args(plan.runtime_id, plan.page_size, model.extra_args)]
    else:
        args += ["--max-total-tokens", str(OWN_POOL_MAX_TOTAL_TOKENS)]
    running = model.max_running_requests or max_running_requests
    if running is not None:
        args += ["--max-running-requests", str(running)]
    cpu = plan.device.is_cpu
    if not cpu:
        args += ["--base-gpu-id", plan.device.name.split(":")[1]]
    env = {**(base_env or {}), **dict(model.env), FLEET_MARKER: fleet_id}
    if schedule is not None:
        env.update(schedule.environ())
    if use_arena:
        # A lent tier starts with no slabs: the launcher's lending round sets its cap.
        join = ArenaJoin.from_env(FineslabEnv.from_environ({
            **ArenaJoin(fleet_id, plan.runtime_id, plan.key_pool, plan.weights_in_arena,
                        model.layer_streaming is not None,
                        prefix_lending=None if model.prefix_lending is None else 0).environ(),
            **prepared.kv_env}))
        assert join is not None
        if contract_dir is None:
            env.update(join.environ())
        else:
            path = join.contract(plan.device.name, planned, files).write(
                contract_dir / f"{plan.runtime_id}.contract.json")
            env.update({ARENA_VAR: join.arena_name, RUNTIME_ID_VAR: join.runtime_id,
                        CONTRACT_VAR: str(path)})
        if model.prefix_lending is not None:
            args += ["--radix-cache-backend", LENT_RADIX_BACKEND]
        if not model.cache_squeeze:
            env[CACHE_SQUEEZE_VAR] = "0"
    return ServerSpec(str(prepared.model_path), port or free_port(), cpu=cpu,
                      extra_args=(*args, *model.extra_args), env=env)
