// The all-reduce of linvis' data-parallel training on its own: the median time to sum a float32
// gradient of N elements over the workers (c10d Gloo, linvis::train::Distributed), in buckets of 25 MB
// as GradientReducer sends them. Run one process per worker with the torchrun environment, e.g. on
// one machine:
//
//   for r in 0 1; do RANK=$r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29600 \
//       build/bench_allreduce 5717416 20 & done; wait
//
// Arguments: elements (default 5,717,416: deit_tiny's parameters) and repetitions (default 20).
// Rank 0 prints one line: elements, MB, buckets, median and min milliseconds, and GB/s of gradient.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <torch/torch.h>

#include "linvis/train/distributed.h"

int main(int argc, char** argv) {
    const int64_t elements = argc > 1 ? std::atoll(argv[1]) : 5717416;
    const int reps = argc > 2 ? std::atoi(argv[2]) : 20;
    torch::set_num_threads(1);
    const auto env = linvis::train::distributed_env_from_environment();
    auto dist = linvis::train::Distributed::create(env, "gloo", 60.0);
    const int64_t bucket = (25 << 20) / 4;
    std::vector<torch::Tensor> buckets;
    for (int64_t done = 0; done < elements; done += bucket)
        buckets.push_back(torch::ones({std::min(bucket, elements - done)}));
    std::vector<double> ms;
    for (int i = 0; i < reps + 1; ++i) {
        dist->barrier();
        const auto start = std::chrono::steady_clock::now();
        std::vector<std::unique_ptr<linvis::train::Distributed::Work>> works;
        for (auto& b : buckets) works.push_back(dist->all_reduce_sum_async(b));
        for (auto& w : works) w->wait();
        const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
        if (i > 0) ms.push_back(t);  // the first pass connects and warms up
    }
    std::sort(ms.begin(), ms.end());
    if (env.rank == 0)
        std::printf("all-reduce of %lld float32 (%.1f MB, %zu buckets) over %lld processes: median %.2f ms, min %.2f ms, "
                    "%.2f GB/s\n",
                    static_cast<long long>(elements), elements * 4e-6, buckets.size(),
                    static_cast<long long>(env.world_size), ms[ms.size() / 2], ms.front(),
                    elements * 4e-6 / ms[ms.size() / 2]);
    return 0;
}
