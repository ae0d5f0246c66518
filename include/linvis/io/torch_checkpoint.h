// Reading official PyTorch checkpoints (torch.save zip format) without Python.
//
// Official training checkpoints pickle much more than tensors: optimizer state, yacs
// CfgNode configs (ViT³), argparse Namespaces (DiT³, T⁵), collections.OrderedDict state
// dicts (ViL), numpy scalars. LibTorch's torch::pickle_load rejects unknown classes, so
// this reader opens the zip with caffe2::serialize::PyTorchStreamReader and runs its own
// pickle machine (protocols 2-5, the opcodes torch.save emits) that turns every object it
// does not know into a generic Object node (class name, constructor args, BUILD state,
// dict/list items) instead of failing. Tensors are rebuilt from the archive's storage
// records exactly like torch.load (views that share a storage share memory here too).
// Specs: vit3_t5_official.md A8/B6, vil_official.md 3.2-3.3, ttt_linear_reference.md 8.5.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>


namespace linvis::io {

struct Value;
using ValuePtr = std::shared_ptr<Value>;

// One node of an unpickled object tree. Nodes are shared (pickle memo), so a dict reached
// twice is the same node.
struct Value {
    enum class Kind {
        None,
        Bool,
        Int,
        Float,
        String,   // str (UTF-8 bytes as stored)
        Bytes,    // bytes / bytearray / Python-2 str
        List,
        Tuple,
        Set,      // set / frozenset (elements in `items`)
        Dict,     // dict or collections.OrderedDict (class_name says which); ordered entries
        Tensor,
        Storage,  // a bare torch storage (only reachable if a checkpoint pickles storages directly)
        Global,   // a class or function reference (GLOBAL/STACK_GLOBAL): class_name = "module.name"
        Object,   // an instance of anything else: class_name, args, state, entries, items
    };
    Kind kind = Kind::None;
    bool boolean = false;
    int64_t integer = 0;
    double real = 0.0;
    std::string text;                                 // String, Bytes
    std::vector<ValuePtr> items;                      // List, Tuple, Set; list items of a list-subclass Object
    std::vector<std::pair<ValuePtr, ValuePtr>> entries;  // Dict; dict items of a dict-subclass Object (CfgNode)
    torch::Tensor tensor;                             // Tensor; Storage: 1-D tensor over the whole storage
    std::string class_name;                           // Global, Object, Dict ("collections.OrderedDict" or "")
    ValuePtr args;                                    // Object: constructor arguments (REDUCE/NEWOBJ), a Tuple
    ValuePtr state;                                   // Object/Dict: the BUILD state (e.g. Namespace's __dict__)

    Value() = default;
    Value(const Value&) = default;
    Value& operator=(const Value&) = default;
    // Releases children iteratively, so a deeply nested (hostile) pickle cannot overflow the stack.
    ~Value();

    bool is_dict_like() const { return kind == Kind::Dict || (kind == Kind::Object && !entries.empty()); }
    // Entry of a Dict (or dict-subclass Object) whose key is the string `key`; nullptr if none.
    const Value* find(const std::string& key) const;
    // Object attributes: the BUILD state when it is a dict (argparse.Namespace, most classes),
    // else the dict entries (yacs CfgNode). Returns nullptr when there is no such attribute.
    const Value* attribute(const std::string& name) const;
};

// Short one-line description for reports: "dict(5)", "tensor float32 [3, 4]",
// "object argparse.Namespace", "int 5", "str 'cpu'".
std::string describe(const Value& value);
// Multi-line indented dump, at most `max_depth` levels and `max_items` entries per container.
std::string dump(const Value& value, int max_depth = 4, int max_items = 20);

// What read_torch_checkpoint found in the archive.
struct CheckpointContents {
    std::string path;
    ValuePtr root;                     // the unpickled data.pkl
    std::vector<std::string> records;  // every record name in the zip (without the archive prefix)
    int64_t format_version = 0;        // the archive's "version" record
    std::string byteorder;             // "little" (or "" when the record is absent: pre-2.0 writers)
    int64_t num_storages = 0;          // distinct data/<key> storages loaded
};

// The allow-list. A pickle may only name (GLOBAL, STACK_GLOBAL, INST) these classes and
// functions; any other global (posix.system, os.system, builtins.eval, subprocess.Popen,
// __main__.Anything ...) makes the whole read fail with one linvis::Error naming the global
// and its offset, at the opcode that names it, so nothing of the file is returned:
//   tensors      torch._utils._rebuild_tensor{,_v2,_v3}, _rebuild_parameter{,_with_state},
//                torch._tensor._rebuild_from_type{,_v2}, torch.Tensor, torch.nn.parameter.Parameter,
//                torch.Size, torch.device, torch.torch_version.TorchVersion,
//                torch[.cuda].<T>Storage (the typed storages), torch.<dtype> (torch.float32, ...)
//   TorchScript  torch.jit._pickle.restore_type_tag, build_{int,double,bool,tensor,generic}list
//   containers   collections.OrderedDict; builtins / __builtin__ dict, list, tuple, set, frozenset,
//                bytes, bytearray, int, long, float, complex, str, unicode, bool, slice, object;
//                _codecs.encode, copyreg._reconstructor / copy_reg._reconstructor
//   configs      argparse.Namespace, yacs.config.CfgNode, pathlib.{Pure,}{Posix,Windows}Path
//   numpy        numpy.dtype, numpy.ndarray, numpy{.core,._core}.multiarray.{scalar,_reconstruct}
// Nothing named is ever called except the tensor rebuild functions; the others become inert
// Object/Dict/Set/Bytes nodes.
bool pickle_global_allowed(const std::string& module, const std::string& name);

// Reads a torch.save checkpoint: the zip archive (torch >= 1.6 format; also what
// torch::pickle_save writes) or the legacy pre-1.6 format (_use_new_zipfile_serialization=False):
// a pickled magic number 0x1950a86a20f9469cfc6c, protocol version 1001, a sys_info dict, the
// object pickle whose persistent ids are ('storage', storage_type, root_key, location, numel,
// view_metadata), a pickled list of storage keys, then per key an 8-byte little-endian element
// count and the raw bytes. Both go through the same unpickler and allow-list.
// Every malformed input throws linvis::Error naming `path` and the problem (not a zip nor a
// legacy file, a global outside the allow-list, unknown opcode and its offset, stack underflow, bad memo index,
// missing storage record, tensor view outside its storage, big-endian data ...).
// Tensors come back on the CPU with the checkpoint's dtype, strides and storage offset.
CheckpointContents read_torch_checkpoint(const std::string& path);

// Unpickles a data.pkl byte string. `load_storage(key, dtype)` returns the raw bytes of
// storage `key` as a 1-D uint8 tensor (read_torch_checkpoint reads archive record
// data/<key>). `source` names the input in error messages.
ValuePtr unpickle(const std::string& bytes, const std::function<torch::Tensor(const std::string& key)>& load_storage,
                  const std::string& source);

// What extract_state_dict kept and dropped, for the convert-checkpoint report.
struct StateDictReport {
    std::string chosen_key;                 // "" when the top level itself is the state dict
    int64_t kept = 0;                       // tensors returned
    int64_t prefix_stripped = 0;            // keys that lost a leading "module."
    std::vector<std::string> dropped;       // "optimizer: dict(2)", "config: object yacs.config.CfgNode", ...
    std::vector<std::string> non_tensors;   // entries inside the chosen dict that were not tensors
};

// Picks the model state dict out of a checkpoint:
//  - the top level itself when it is a dict whose values are tensors, else
//  - prefer_ema=false: the first of 'model', 'state_dict', 'model_state', 'model_state_dict', 'module';
//  - prefer_ema=true:  the first of 'model_ema', 'state_dict_ema', 'ema' (error if none exists).
// A leading "module." (DataParallel/DDP) is removed from every key. Non-tensor entries
// are dropped and reported. Throws linvis::Error listing the top-level keys when no
// state dict is found or the stripped keys collide. `chosen_key` (may be null) receives
// the key used ("" for the top level).
std::map<std::string, torch::Tensor> extract_state_dict(const CheckpointContents& contents, bool prefer_ema,
                                                        std::string* chosen_key, StateDictReport* report = nullptr);

}  // namespace linvis::io
