import sys, time, torch
from mambaserve.bench.one_batch import OneBatchConfig, _MambaserveBackend
from mambaserve.bench.presets import materialize_preset
name = sys.argv[1]
path, fmt, tmp = materialize_preset(name, None, dtype=torch.bfloat16, device="cuda")
c = OneBatchConfig(preset=name, batch_sizes=[1, 8], input_lens=[2048], output_len=2,
                   dtype="bfloat16", device="cuda",
                   engine={"enforce_eager": False, "chunked_prefill_size": 16384})
be = _MambaserveBackend(path, c, fmt)
for b in (1, 1, 8, 1, 1):
    s0 = torch.cuda.memory_stats()
    p, _ = be.run(b, 2048, 2, 7)
    s1 = torch.cuda.memory_stats()
    print(f"b={b} prefill {p*1e3:.1f} ms  alloc_retries +{s1['num_alloc_retries']-s0['num_alloc_retries']}"
          f"  cudaMalloc +{s1['num_device_alloc']-s0['num_device_alloc']}"
          f"  reserved {torch.cuda.memory_reserved()/2**30:.1f} GiB", flush=True)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as prof:
    be.run(1, 2048, 2, 9)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
