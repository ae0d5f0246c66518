// The trainer's view of data: a source of (images, labels) batches whose order and
// augmentation are a pure function of (seed, epoch, batch index), so a run resumed from a
// checkpoint (even mid-epoch) sees exactly the batches the uninterrupted run would have.
#pragma once

#include <cstdint>
#include <string>

#include <torch/torch.h>

namespace linvis::train {

class BatchSource {
public:
    virtual ~BatchSource() = default;
    // Prepares epoch `epoch`'s deterministic order.
    virtual void start_epoch(int64_t epoch) = 0;
    // Fills the next batch of this epoch; false when the epoch is done.
    virtual bool next(torch::Tensor& images, torch::Tensor& labels) = 0;
    // Skips the next `count` batches (resume mid-epoch) without producing them where possible.
    virtual void skip(int64_t count);
    virtual int64_t batches_per_epoch() const = 0;
    virtual int64_t num_examples() const = 0;
    // Images that could not be read and were skipped so far (0 for in-memory data).
    virtual int64_t skipped_images() const { return 0; }
    // Restricts the source to shard `rank` of `world_size` processes (distributed training), with
    // the semantics of torch's DistributedSampler applied to each epoch's order (shard_order).
    // training: the batch size given at construction is the global batch, each process takes
    // batch / world_size (which must divide) and the order is padded to equal shard lengths, so
    // global batch b of every process together is batch b of one process (when world_size divides
    // the number of examples). Otherwise (evaluation): no padding, the batch size is per process.
    // Call before start_epoch.
    virtual void shard(int64_t rank, int64_t world_size, bool training);
};

// Shard `rank` of `world_size` of an epoch's order, as torch's DistributedSampler: pad (when `pad`)
// by repeating the order's first entries up to a multiple of world_size, then take every
// world_size-th entry from position rank.
std::vector<int64_t> shard_order(const std::vector<int64_t>& order, int64_t rank, int64_t world_size, bool pad);
// Length of that shard for an order of n entries.
int64_t shard_length(int64_t n, int64_t rank, int64_t world_size, bool pad);

// Light augmentation for small in-memory images: random crop after zero padding and a
// horizontal flip (the standard CIFAR/Fashion-MNIST recipe). Each image's draw depends on
// (seed, epoch, its index in the data set) only, so a shard sees what one process would.
struct TensorAugment {
    int64_t pad = 0;      // 0: no random crop
    bool hflip = false;
};

// Batches from tensors held in memory: images (N, C, H, W) float, labels (N) int64.
class TensorBatchSource : public BatchSource {
public:
    TensorBatchSource(torch::Tensor images, torch::Tensor labels, int64_t batch_size, bool shuffle,
                      uint64_t seed, TensorAugment augment = {}, bool drop_last = false);
    void start_epoch(int64_t epoch) override;
    bool next(torch::Tensor& images, torch::Tensor& labels) override;
    void skip(int64_t count) override;
    int64_t batches_per_epoch() const override;
    int64_t num_examples() const override { return images_.size(0); }
    void shard(int64_t rank, int64_t world_size, bool training) override;

private:
    torch::Tensor images_, labels_, order_;
    int64_t batch_size_, global_batch_size_;  // per process; as constructed (the global batch)
    bool shuffle_, drop_last_;
    uint64_t seed_;
    TensorAugment augment_;
    int64_t epoch_ = 0, position_ = 0, batch_index_ = 0;
    int64_t rank_ = 0, world_size_ = 1;
    bool pad_ = false;
};

// A 64-bit seed mixed from several integers (splitmix64), for per-epoch / per-batch streams.
uint64_t mix_seed(uint64_t a, uint64_t b, uint64_t c = 0);

}  // namespace linvis::train
