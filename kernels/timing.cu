/*
Timing helpers for the benchmark harness (libnn/bench/harness.py).

spin_wait: one thread busy-waits on the SM clock for `cycles` cycles. The harness launches it before a
batch of timed runs so that the host can queue the whole batch while the GPU is busy; the CUDA events
around each run then measure GPU execution alone, not the host's launch overhead, which the harness
reports separately. Limits: the clock is per SM and runs at the SM clock rate, so `cycles` is a duration
only approximately (the harness converts from the device's clock rate).
*/

extern "C" __global__ void spin_wait(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
