#include "linvis/train/data.h"

#include <random>

#include "linvis/core/error.h"

namespace linvis::train {

uint64_t mix_seed(uint64_t a, uint64_t b, uint64_t c) {
    auto splitmix = [](uint64_t x) {
        x += 0x9e3779b97f4a7c15ULL;
        x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
        x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
        return x ^ (x >> 31);
    };
    return splitmix(splitmix(splitmix(a) ^ b) ^ c);
}

std::vector<int64_t> shard_order(const std::vector<int64_t>& order, int64_t rank, int64_t world_size, bool pad) {
    LINVIS_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "shard: rank ", rank, " is not in [0, ",
                 world_size, ")");
    const int64_t n = static_cast<int64_t>(order.size());
    std::vector<int64_t> out;
    out.reserve(static_cast<size_t>(shard_length(n, rank, world_size, pad)));
    const int64_t total = pad ? (n + world_size - 1) / world_size * world_size : n;
    for (int64_t i = rank; i < total && n > 0; i += world_size) out.push_back(order[static_cast<size_t>(i % n)]);
    return out;
}

int64_t shard_length(int64_t n, int64_t rank, int64_t world_size, bool pad) {
    if (pad) return (n + world_size - 1) / world_size;
    return n > rank ? (n - rank + world_size - 1) / world_size : 0;
}

void BatchSource::shard(int64_t rank, int64_t world_size, bool training) {
    LINVIS_CHECK(world_size == 1, "this data source cannot be split across ", world_size, " processes");
}

void BatchSource::skip(int64_t count) {
    torch::Tensor images, labels;
    for (int64_t i = 0; i < count && next(images, labels); ++i) {
    }
}

TensorBatchSource::TensorBatchSource(torch::Tensor images, torch::Tensor labels, int64_t batch_size, bool shuffle,
                                     uint64_t seed, TensorAugment augment, bool drop_last)
    : images_(std::move(images)), labels_(std::move(labels)), batch_size_(batch_size), global_batch_size_(batch_size),
      shuffle_(shuffle),
      drop_last_(drop_last), seed_(seed), augment_(augment) {
    LINVIS_CHECK(images_.dim() == 4, "TensorBatchSource: images must be (N, C, H, W), got ",
                 shape_string(images_.sizes()));
    LINVIS_CHECK(labels_.dim() == 1 && labels_.size(0) == images_.size(0), "TensorBatchSource: labels must be (",
                 images_.size(0), "), got ", shape_string(labels_.sizes()));
    LINVIS_CHECK(batch_size_ > 0, "batch size must be positive, got ", batch_size_);
    start_epoch(0);
}

void TensorBatchSource::shard(int64_t rank, int64_t world_size, bool training) {
    LINVIS_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "shard: rank ", rank, " is not in [0, ",
                 world_size, ")");
    batch_size_ = global_batch_size_;
    if (training) {
        LINVIS_CHECK(batch_size_ % world_size == 0, "--batch-size ", batch_size_,
                     " (the global batch) must be divisible by the number of processes, ", world_size);
        batch_size_ /= world_size;
    }
    rank_ = rank;
    world_size_ = world_size;
    pad_ = training;
    start_epoch(epoch_);
}

void TensorBatchSource::start_epoch(int64_t epoch) {
    epoch_ = epoch;
    position_ = 0;
    batch_index_ = 0;
    const int64_t n = images_.size(0);
    std::vector<int64_t> order(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
    if (shuffle_) {
        std::mt19937_64 rng(mix_seed(seed_, static_cast<uint64_t>(epoch)));
        std::shuffle(order.begin(), order.end(), rng);
    }
    if (world_size_ > 1) order = shard_order(order, rank_, world_size_, pad_);
    order_ = torch::tensor(order, torch::kLong);
}

int64_t TensorBatchSource::batches_per_epoch() const {
    const int64_t n = world_size_ > 1 ? shard_length(images_.size(0), rank_, world_size_, pad_) : images_.size(0);
    return drop_last_ ? n / batch_size_ : (n + batch_size_ - 1) / batch_size_;
}

void TensorBatchSource::skip(int64_t count) {
    for (int64_t i = 0; i < count && batch_index_ < batches_per_epoch(); ++i) {
        position_ = std::min(position_ + batch_size_, order_.size(0));
        ++batch_index_;
    }
}

bool TensorBatchSource::next(torch::Tensor& images, torch::Tensor& labels) {
    if (batch_index_ >= batches_per_epoch()) return false;
    const int64_t end = std::min(position_ + batch_size_, order_.size(0));
    torch::Tensor index = order_.slice(0, position_, end);
    images = images_.index_select(0, index);
    labels = labels_.index_select(0, index);
    if (augment_.pad > 0 || augment_.hflip) {
        const int64_t h = images.size(2), w = images.size(3), p = augment_.pad;
        torch::Tensor padded = p > 0 ? torch::constant_pad_nd(images, {p, p, p, p}, 0.0) : images;
        std::uniform_int_distribution<int64_t> offset(0, 2 * p);
        std::bernoulli_distribution flip(0.5);
        std::vector<torch::Tensor> out;
        const auto* indices = index.data_ptr<int64_t>();
        for (int64_t i = 0; i < images.size(0); ++i) {
            // Per image, not per batch: a shard of the batch draws what one process would.
            std::mt19937_64 rng(mix_seed(seed_, static_cast<uint64_t>(epoch_), static_cast<uint64_t>(indices[i]) + 1));
            const int64_t dy = offset(rng), dx = offset(rng);
            torch::Tensor crop = padded[i].slice(1, dy, dy + h).slice(2, dx, dx + w);
            if (augment_.hflip && flip(rng)) crop = crop.flip({2});
            out.push_back(crop);
        }
        images = torch::stack(out);
    }
    position_ = end;
    ++batch_index_;
    return true;
}

}  // namespace linvis::train
