#include "linvis/models/imagenet.h"

#include "linvis/core/error.h"

namespace linvis::models {
namespace {

struct ImageNetClass {
    const char* synset;
    const char* lemmas;
};

const ImageNetClass kClasses[] = {
#include "imagenet_classes.inc"
};
static_assert(sizeof(kClasses) / sizeof(kClasses[0]) == kImageNetClasses, "ImageNet-1k has 1000 classes");

const ImageNetClass& entry(int64_t index) {
    LINVIS_CHECK(index >= 0 && index < kImageNetClasses, "ImageNet class index: expected 0..999, got ", index);
    return kClasses[index];
}

}  // namespace

const char* imagenet_synset(int64_t index) { return entry(index).synset; }
const char* imagenet_lemmas(int64_t index) { return entry(index).lemmas; }

std::string imagenet_class_name(int64_t index) {
    const std::string lemmas = entry(index).lemmas;
    return lemmas.substr(0, lemmas.find(','));
}

}  // namespace linvis::models
