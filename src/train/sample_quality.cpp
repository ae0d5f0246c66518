// Sample quality with a linvis classifier: the Frechet distance of FID (Heusel et al. 2017) on the
// classifier's penultimate features, and the classifier's accuracy on class-conditional samples.
#include "linvis/train/sample_quality.h"

#include <cmath>

#include "linvis/core/error.h"

namespace linvis::train {

GaussianStats gaussian_statistics(const torch::Tensor& features) {
    LINVIS_CHECK(features.dim() == 2, "gaussian_statistics: expected features (N, D), got ", features.dim(),
                 " dimensions");
    LINVIS_CHECK(features.size(0) >= 2, "gaussian_statistics: need at least 2 feature vectors, got ", features.size(0));
    const torch::Tensor f = features.to(torch::kFloat64);
    GaussianStats s;
    s.count = f.size(0);
    s.mean = f.mean(0);
    const torch::Tensor centred = f - s.mean;
    s.cov = centred.t().matmul(centred) / static_cast<double>(s.count - 1);
    LINVIS_CHECK(torch::isfinite(s.cov).all().item<bool>(), "gaussian_statistics: the features are not finite");
    return s;
}

namespace {

// The square root of a symmetric positive semi-definite matrix (negative eigenvalues of round-off set to 0).
torch::Tensor sqrt_psd(const torch::Tensor& m) {
    const torch::Tensor sym = (m + m.t()) / 2;
    auto [values, vectors] = at::linalg_eigh(sym, "L");  // at::, not torch::linalg: torch 2.x headers differ
    return vectors.matmul(torch::diag(values.clamp_min(0).sqrt())).matmul(vectors.t());
}

}  // namespace

double frechet_distance(const GaussianStats& a, const GaussianStats& b) {
    LINVIS_CHECK(a.mean.defined() && b.mean.defined() && a.mean.dim() == 1 && a.mean.sizes() == b.mean.sizes(),
                 "frechet_distance: the two feature sets have different widths (", a.mean.sizes(), " and ",
                 b.mean.sizes(), ")");
    const torch::Tensor m1 = a.mean.to(torch::kFloat64), m2 = b.mean.to(torch::kFloat64);
    const torch::Tensor s1 = a.cov.to(torch::kFloat64), s2 = b.cov.to(torch::kFloat64);
    const double mean_term = (m1 - m2).pow(2).sum().item<double>();
    // tr((S1 S2)^1/2) = tr((sqrt(S1) S2 sqrt(S1))^1/2): similar matrices, the second one symmetric PSD.
    const torch::Tensor r1 = sqrt_psd(s1);
    torch::Tensor inner = r1.matmul(s2).matmul(r1);
    inner = (inner + inner.t()) / 2;
    const torch::Tensor eig = at::linalg_eigvalsh(inner, "L");
    const double tr_sqrt = eig.clamp_min(0).sqrt().sum().item<double>();
    const double fd = mean_term + s1.trace().item<double>() + s2.trace().item<double>() - 2.0 * tr_sqrt;
    LINVIS_CHECK(std::isfinite(fd), "frechet_distance: the result is not finite (", fd, ")");
    return fd;
}

double frechet_distance(const torch::Tensor& features_a, const torch::Tensor& features_b) {
    return frechet_distance(gaussian_statistics(features_a), gaussian_statistics(features_b));
}

torch::Tensor diffusion_pixels_to_classifier_input(const torch::Tensor& x, int64_t size, const std::vector<double>& mean,
                                                   const std::vector<double>& std) {
    LINVIS_CHECK(x.dim() == 4, "diffusion_pixels_to_classifier_input: expected images (B, C, H, W), got ", x.dim(),
                 " dimensions");
    const int64_t c = x.size(1);
    LINVIS_CHECK(!mean.empty() && mean.size() == std.size() && (mean.size() == 1 || static_cast<int64_t>(mean.size()) == c),
                 "diffusion_pixels_to_classifier_input: expected 1 or ", c, " mean/std values, got ", mean.size(), " and ",
                 std.size());
    torch::Tensor v = ((x.to(torch::kFloat32) + 1) / 2).clamp(0.0, 1.0);
    if (size != v.size(2) || size != v.size(3)) {
        namespace F = torch::nn::functional;
        // train/data_sources.cpp resizes 28 -> 32 this way; this is the way back.
        const auto resize = F::InterpolateFuncOptions()
                                .size(std::vector<int64_t>{size, size})
                                .mode(torch::kBicubic)
                                .align_corners(false)
                                .antialias(size < v.size(2));
        v = F::interpolate(v, resize).clamp(0.0, 1.0);
    }
    const int64_t k = static_cast<int64_t>(mean.size());
    const torch::Tensor m = torch::tensor(mean, torch::kFloat32).view({1, k, 1, 1});
    const torch::Tensor s = torch::tensor(std, torch::kFloat32).view({1, k, 1, 1});
    return ((v - m) / s).contiguous();
}

ClassifierOutputs classifier_outputs(models::VisionModel& classifier, const torch::Tensor& inputs, int64_t batch_size) {
    LINVIS_CHECK(batch_size >= 1, "classifier_outputs: batch size must be >= 1, got ", batch_size);
    classifier.eval();
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> features, logits;
    for (int64_t i = 0; i < inputs.size(0); i += batch_size) {
        const torch::Tensor batch = inputs.narrow(0, i, std::min(batch_size, inputs.size(0) - i));
        const torch::Tensor tokens = classifier.forward_features(batch);
        features.push_back(classifier.forward_head(tokens, true).to(torch::kFloat32));
        logits.push_back(classifier.forward_head(tokens, false).to(torch::kFloat32));
    }
    return {torch::cat(features, 0), torch::cat(logits, 0)};
}

double top1_accuracy(const torch::Tensor& logits, const torch::Tensor& labels) {
    LINVIS_CHECK(logits.dim() == 2 && labels.dim() == 1 && logits.size(0) == labels.size(0) && labels.size(0) > 0,
                 "top1_accuracy: expected logits (N, K) and labels (N,) with N > 0, got ", logits.sizes(), " and ",
                 labels.sizes());
    const torch::Tensor correct = logits.argmax(1).eq(labels.to(torch::kInt64));
    return 100.0 * correct.to(torch::kFloat64).mean().item<double>();
}

}  // namespace linvis::train
