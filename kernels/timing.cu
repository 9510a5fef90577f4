/*
Timing helpers (libnn/runtime/timing.py's hold_stream launches them).

spin_wait: one thread busy-waits on the SM clock for `cycles` cycles. time_gpu launches it before a
batch of timed runs so that the host can queue the whole batch while the GPU is busy; the CUDA events
around each run then measure GPU execution alone, not the host's launch overhead, which the harness
reports separately. The benchmark harness's kernel_split queues its profiled calls behind it in the same
way, and some tests use it to keep the GPU busy while they check what the host does. Limits: the clock is
per SM and runs at the SM clock rate, so `cycles` is a duration only approximately (the harness converts
from the device's clock rate).
*/

extern "C" __global__ void spin_wait(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
