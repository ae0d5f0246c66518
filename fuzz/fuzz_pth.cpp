// libFuzzer target for the torch.save reader (src/io/torch_checkpoint.cpp): the zip container
// (through LibTorch's PyTorchStreamReader), the legacy pre-1.6 format, the pickle machine and its
// allow-list, tensor rebuilding over storages, state-dict extraction and the report printers.
//
// The first input byte picks the entry point:
//   even: the rest is a file given to read_torch_checkpoint (zip or legacy), then
//         extract_state_dict (plain and EMA), describe and dump;
//   odd:  the rest is a data.pkl given to unpickle(), whose storage loader hands out a 64-byte
//         zero storage for keys "0".."3" and refuses others.
// Properties: only linvis::Error escapes; an accepted tensor lies inside its storage (reading
// every element is done by sum(), which ASan checks); extracted state dicts hold only tensors.
#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

#include <torch/torch.h>

#include "fuzz_util.h"
#include "linvis/core/error.h"
#include "linvis/io/torch_checkpoint.h"

using namespace linvis;

namespace {

void touch_tensors(const io::Value& root) {
    // Iterative walk (a hostile pickle may nest deeply), each node once: memo sharing makes the tree a graph in
    // which a few hundred bytes can reference one list of thousands of items thousands of times (capping the
    // visits alone still queued billions of pointers: a fuzz finding in the harness, not in the reader).
    std::vector<const io::Value*> pending{&root};
    std::unordered_set<const io::Value*> seen{&root};
    const auto push = [&](const io::Value* v) {
        if (v != nullptr && seen.size() < 200000 && seen.insert(v).second) pending.push_back(v);
    };
    while (!pending.empty()) {
        const io::Value* v = pending.back();
        pending.pop_back();
        if ((v->kind == io::Value::Kind::Tensor || v->kind == io::Value::Kind::Storage) && v->tensor.defined() &&
            v->tensor.numel() > 0 && v->tensor.numel() < (1 << 20)) {
            (void)v->tensor.to(torch::kFloat64).sum().item<double>();
        }
        for (const auto& item : v->items) push(item.get());
        for (const auto& [k, val] : v->entries) {
            push(k.get());
            push(val.get());
        }
        push(v->args.get());
        push(v->state.get());
    }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    torch::set_num_threads(1);
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size < 1) return 0;
    static const std::filesystem::path dir = fuzz::scratch_dir("fuzz_pth");
    const bool raw_pickle = (data[0] & 1) != 0;
    try {
        if (raw_pickle) {
            const std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
            auto loader = [](const std::string& key) {
                LINVIS_CHECK(key == "0" || key == "1" || key == "2" || key == "3", "no storage ", key);
                return torch::zeros({64}, torch::kUInt8);
            };
            io::ValuePtr root = io::unpickle(bytes, loader, "fuzz.pkl");
            if (!root) fuzz::violated("fuzz_pth", "unpickle returned null");
            touch_tensors(*root);
            (void)io::describe(*root);
            (void)io::dump(*root, 3, 8);
        } else {
            const std::string path = fuzz::write_scratch_file(dir / "input.pth", data + 1, size - 1);
            const io::CheckpointContents contents = io::read_torch_checkpoint(path);
            if (!contents.root) fuzz::violated("fuzz_pth", "read_torch_checkpoint returned no root");
            touch_tensors(*contents.root);
            (void)io::dump(*contents.root, 3, 8);
            for (bool ema : {false, true}) {
                try {
                    std::string chosen;
                    io::StateDictReport report;
                    const auto sd = io::extract_state_dict(contents, ema, &chosen, &report);
                    for (const auto& [name, t] : sd)
                        if (!t.defined()) fuzz::violated("fuzz_pth", "undefined tensor in a state dict: " + name);
                } catch (const Error&) {
                }
            }
        }
    } catch (const Error&) {
        return 0;  // refused cleanly
    }
    return 0;
}
