// ImageNet-1k class names, built in so that `linvis predict` needs no extra file.
#pragma once

#include <cstdint>
#include <string>

namespace linvis::models {

constexpr int64_t kImageNetClasses = 1000;

// WordNet synset id ("n01440764") and the comma-separated lemmas ("tench, Tinca tinca")
// of ImageNet-1k class `index` (0..999); throws linvis::Error out of range.
const char* imagenet_synset(int64_t index);
const char* imagenet_lemmas(int64_t index);
// The first lemma only: a short human-readable name ("tench").
std::string imagenet_class_name(int64_t index);

}  // namespace linvis::models
