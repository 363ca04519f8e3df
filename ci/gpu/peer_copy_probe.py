"""Cross-device copy bandwidth with peer access enabled (torch enables it for cuda:0 -> cuda:1
copies) and within one device, for the staged-IPC comparison; median of 5 timed batches."""
import statistics, time, torch
for size in [1 << 20, 16 << 20, 256 << 20, 1 << 30]:
    a = torch.empty(size, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(size, dtype=torch.uint8, device="cuda:1")
    c = torch.empty(size, dtype=torch.uint8, device="cuda:0")
    iters = 5 if size >= 256 << 20 else 50
    for name, dst in [("torch peer copy device 0 -> 1", b), ("torch copy within device 0", c)]:
        dst.copy_(a); torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        samples = []
        for _ in range(5):
            t = time.perf_counter_ns()
            for _ in range(iters):
                dst.copy_(a)
            torch.cuda.synchronize(0); torch.cuda.synchronize(1)
            samples.append((time.perf_counter_ns() - t) / iters)
        print(f"ipc-staged,{name},{size},1,{size / statistics.median(samples):.3f},GB/s", flush=True)
    print(f"# can_device_access_peer(0,1)={torch.cuda.can_device_access_peer(0, 1)}")
