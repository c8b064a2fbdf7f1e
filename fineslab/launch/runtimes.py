"""SGLang runtimes of a fleet: their command lines, one way for every precision.

`server_spec(plan, prepared)` turns a `RuntimePlan` and its model's prepared checkpoint
(`fineslab.quant.fleet.PrecisionRuntime`) into the SGLang server: the served name is the
model's name in the fleet (the OpenAI `model` field), the page size is the arena block's
tokens, the precision's arguments (`--dtype`, `--quantization`, `--kv-cache-dtype`, ...) come
from the prepared checkpoint, and the environment carries the plugin's join request
(`FINESLAB_ARENA=<fleet_id>`, `FINESLAB_RUNTIME_ID=<runtime id>`), the quantized KV format
(`FINESLAB_KV_FORMAT`, `FINESLAB_KV_SCALES`), the engine schedule (`FINESLAB_ENGINE_POLICY`,
with `local_scheduler: engine`) and the model's `env`. This is the one way
fineslab starts a runtime of any precision.

The supervision of the processes started from these specs is in `supervisor.py`.
"""

from __future__ import annotations

import logging

from fineslab.errors import EnvironmentSetupError
from fineslab.launch.config import flag_value
from fineslab.launch.leftovers import FLEET_MARKER
from fineslab.launch.plan import RuntimePlan, prefill_chunk_args
from fineslab.quant.fleet import PrecisionRuntime
from fineslab.router.config import TokenBudget
from fineslab.runtime import ServerSpec, free_port
from fineslab.sglang_plugin import ArenaJoin
from fineslab.sglang_plugin.config import LENT_RADIX_BACKEND, EngineSchedule

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


def server_spec(plan: RuntimePlan, prepared: PrecisionRuntime, fleet_id: str, use_arena: bool,
                port: int | None = None, max_running_requests: int | None = None,
                schedule: EngineSchedule | None = None) -> ServerSpec:
    """The SGLang server for one runtime of the plan (see the module docstring); `schedule`:
    the local scheduler inside the runtime (`local_scheduler: engine`)."""
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
    env = {**dict(model.env), FLEET_MARKER: fleet_id}
    if schedule is not None:
        env.update(schedule.environ())
    if use_arena:
        # A lent tier starts with no slabs: the launcher's lending round sets its cap.
        env.update(ArenaJoin(fleet_id, plan.runtime_id, plan.key_pool, plan.weights_in_arena,
                             model.layer_streaming is not None,
                             prefix_lending=None if model.prefix_lending is None else 0
                             ).environ(), **prepared.kv_env)
        if model.prefix_lending is not None:
            args += ["--radix-cache-backend", LENT_RADIX_BACKEND]
    return ServerSpec(str(prepared.model_path), port or free_port(), cpu=cpu,
                      extra_args=(*args, *model.extra_args), env=env)
