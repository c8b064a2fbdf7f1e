"""fineslab's scheduling policies (shipped as `fineslab.scheduler`); pure Python, no SGLang.

    profile_schema, kv_format, curves    profiles: schema, loader, KV block bytes, tables
    devices, roofline                    analytical profiles (python -m fineslab.profile)
    predictors                           chunked-prefill TTFT predictor, throughput helpers
    local/                               batch policies: adaptive (Algorithm 2),
                                         adaptive-early-shed, their -margin peers (a drop
                                         margin learned from first tokens), fcfs,
                                         moore-hodgson; get_batch_policy(name)
    placement/                           placers: mme, mme-exact (Algorithm 1), kvpr, static;
                                         get_placement_policy(name, config); colocation
    elastic                              sleep/wake placement (lru-idle, prism)
    oneiros, selectn                     layer streaming: which layers to lend or offload
    swiftcache                           prefix lending: Algorithm 1 live, the lend budget

See docs/scheduling.md for the formulas.
"""
