#include "linvis/train/checkpoint.h"

#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <filesystem>

#include "linvis/core/error.h"
#include "linvis/io/atomic_file.h"

namespace linvis::train {
namespace {

torch::Tensor string_tensor(const std::string& text) {
    torch::Tensor t = torch::empty({static_cast<int64_t>(text.size())}, torch::kUInt8);
    std::memcpy(t.data_ptr(), text.data(), text.size());
    return t;
}

std::string tensor_string(const torch::Tensor& t) {
    return std::string(static_cast<const char*>(t.data_ptr()), static_cast<size_t>(t.numel()));
}

}  // namespace

void save_checkpoint(const std::string& path, const TrainingState& state, const torch::nn::Module& model,
                     const torch::optim::Optimizer& optimizer, const std::map<std::string, torch::Tensor>* ema) {
    io::write_file_atomically(path, [&](const io::ByteSink& sink) {
        torch::serialize::OutputArchive archive;
        torch::serialize::OutputArchive model_archive, optimizer_archive, ema_archive;
        for (const auto& item : model.named_parameters(true)) model_archive.write(item.key(), item.value());
        for (const auto& item : model.named_buffers(true)) model_archive.write(item.key(), item.value(), true);
        archive.write("model", model_archive);
        optimizer.save(optimizer_archive);
        archive.write("optimizer", optimizer_archive);
        if (ema != nullptr) {
            for (const auto& [name, tensor] : *ema) ema_archive.write(name, tensor, true);
            archive.write("ema", ema_archive);
        }
        archive.write("epoch", torch::tensor(state.epoch, torch::kLong), true);
        archive.write("batch", torch::tensor(state.batch, torch::kLong), true);
        archive.write("step", torch::tensor(state.step, torch::kLong), true);
        archive.write("best_top1", torch::tensor(state.best_top1, torch::kFloat64), true);
        archive.write("config_json", string_tensor(state.config_json), true);
        {
            at::Generator generator = at::detail::getDefaultCPUGenerator();
            std::lock_guard<std::mutex> lock(generator.mutex());
            archive.write("torch_rng", generator.get_state(), true);
        }
        // LibTorch's zip writer streams into the atomic writer's temporary file. A failed write
        // (full disk, file-size limit) must not reach LibTorch: its writer then throws again from
        // its destructor and the process aborts. So the sink's first error is kept, LibTorch is
        // told every byte was written, and the error is raised once save_to has returned.
        std::exception_ptr write_error;
        archive.save_to([&](const void* data, size_t size) -> size_t {
            if (!write_error) {
                try {
                    sink(data, size);
                } catch (...) {
                    write_error = std::current_exception();
                }
            }
            return size;
        });
        if (write_error) {
            try {
                std::rethrow_exception(write_error);
            } catch (const Error& e) {
                fail(e.what(), "; the previous checkpoint is kept");
            }
        }
    });
}

TrainingState load_checkpoint(const std::string& path, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                              std::map<std::string, torch::Tensor>* ema) {
    LINVIS_CHECK(std::filesystem::exists(path), path, ": checkpoint not found");
    torch::serialize::InputArchive archive;
    try {
        archive.load_from(path);
    } catch (const c10::Error& e) {
        fail(path, ": not a readable linvis checkpoint: ", e.what_without_backtrace());
    }
    TrainingState state;
    try {
        torch::serialize::InputArchive model_archive, optimizer_archive;
        archive.read("model", model_archive);
        torch::NoGradGuard no_grad;
        for (auto& item : model.named_parameters(true)) {
            torch::Tensor value;
            model_archive.read(item.key(), value);
            LINVIS_CHECK(value.sizes() == item.value().sizes(), path, ": tensor '", item.key(), "': expected shape ",
                         shape_string(item.value().sizes()), ", got ", shape_string(value.sizes()));
            item.value().copy_(value);
        }
        for (auto& item : model.named_buffers(true)) {
            torch::Tensor value;
            model_archive.read(item.key(), value, true);
            item.value().copy_(value);
        }
        archive.read("optimizer", optimizer_archive);
        optimizer.load(optimizer_archive);
        if (ema != nullptr) {
            torch::serialize::InputArchive ema_archive;
            archive.read("ema", ema_archive);
            for (auto& [name, tensor] : *ema) {
                torch::Tensor value;
                ema_archive.read(name, value, true);
                tensor.copy_(value);
            }
        }
        // InputArchive::read assigns into an undefined tensor but resizes a defined one in place,
        // so every value is read into a fresh tensor.
        auto read_value = [&](const char* key) {
            torch::Tensor value;
            archive.read(key, value, true);
            return value;
        };
        state.epoch = read_value("epoch").item<int64_t>();
        state.batch = read_value("batch").item<int64_t>();
        state.step = read_value("step").item<int64_t>();
        state.best_top1 = read_value("best_top1").item<double>();
        state.config_json = tensor_string(read_value("config_json"));
        at::Generator generator = at::detail::getDefaultCPUGenerator();
        std::lock_guard<std::mutex> lock(generator.mutex());
        generator.set_state(read_value("torch_rng"));
    } catch (const c10::Error& e) {
        fail(path, ": checkpoint does not match this model/optimizer: ", e.what_without_backtrace());
    }
    return state;
}

}  // namespace linvis::train
