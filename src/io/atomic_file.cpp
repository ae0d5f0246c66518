#include "linvis/io/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "linvis/core/error.h"
#include "linvis/core/test_hooks.h"

namespace linvis::io {
namespace {

std::string errno_text(int error) { return std::strerror(error); }

std::string directory_of(const std::string& path) {
    const size_t slash = path.find_last_of('/');
    if (slash == std::string::npos) return ".";
    if (slash == 0) return "/";
    return path.substr(0, slash);
}

// A uniquely named temporary file next to the target; removed on destruction unless committed.
class TempFile {
public:
    explicit TempFile(const std::string& target) : target_(target), directory_(directory_of(target)) {
        static std::atomic<uint64_t> counter{0};
        const size_t slash = target.find_last_of('/');
        const std::string base = target.substr(slash == std::string::npos ? 0 : slash + 1);
        LINVIS_CHECK(!base.empty(), target, ": not a file path");
        for (int attempt = 0; attempt < 100 && fd_ < 0; ++attempt) {
            path_ = directory_ + "/." + base + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
            fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
            if (fd_ < 0 && errno != EEXIST)
                fail(target, ": cannot create a temporary file in ", directory_, ": ", errno_text(errno));
        }
        LINVIS_CHECK(fd_ >= 0, target, ": cannot create a temporary file in ", directory_);
    }
    TempFile(const TempFile&) = delete;
    TempFile& operator=(const TempFile&) = delete;
    ~TempFile() {
        if (fd_ >= 0) ::close(fd_);
        if (!committed_) ::unlink(path_.c_str());
    }

    const std::string& path() const { return path_; }
    const std::string& target() const { return target_; }
    std::string base_name() const {
        const size_t slash = target_.find_last_of('/');
        return target_.substr(slash == std::string::npos ? 0 : slash + 1);
    }

    void write(const void* data, size_t size) {
        const char* bytes = static_cast<const char*>(data);
        while (size > 0) {
            const size_t chunk = std::min<size_t>(size, size_t{1} << 30);  // Linux writes < 2 GiB per call
            const ssize_t written = ::write(fd_, bytes, chunk);
            if (written < 0) {
                if (errno == EINTR) continue;
                fail(target_, ": write failed: ", errno_text(errno));
            }
            bytes += written;
            size -= static_cast<size_t>(written);
        }
    }

    // Closes our descriptor so that another writer can fill the file by name; commit() reopens it.
    void release() {
        if (fd_ >= 0) ::close(fd_);
        fd_ = -1;
    }

    void commit() {
        if (fd_ < 0) {
            fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
            LINVIS_CHECK(fd_ >= 0, target_, ": cannot reopen the temporary file ", path_, ": ", errno_text(errno));
        }
        LINVIS_CHECK(::fsync(fd_) == 0, target_, ": fsync failed: ", errno_text(errno));
        const int fd = fd_;
        fd_ = -1;
        LINVIS_CHECK(::close(fd) == 0, target_, ": close failed: ", errno_text(errno));
        test_stop_point("atomic-write-rename:" + base_name());
        LINVIS_CHECK(::rename(path_.c_str(), target_.c_str()) == 0, target_, ": cannot rename ", path_,
                     " over it: ", errno_text(errno));
        committed_ = true;
        // Make the rename itself durable.
        const int dir = ::open(directory_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dir >= 0) {
            ::fsync(dir);
            ::close(dir);
        }
    }

private:
    std::string target_, directory_, path_;
    int fd_ = -1;
    bool committed_ = false;
};

}  // namespace

void write_file_atomically(const std::string& path, const std::function<void(const ByteSink& sink)>& produce) {
    TempFile temp(path);
    test_stop_point("atomic-write-begin:" + temp.base_name());
    produce([&](const void* data, size_t size) { temp.write(data, size); });
    temp.commit();
}

void write_file_atomically(const std::string& path, std::string_view bytes) {
    write_file_atomically(path, [&](const ByteSink& sink) { sink(bytes.data(), bytes.size()); });
}

void write_file_atomically_via(const std::string& path, const std::function<void(const std::string& temp_path)>& write) {
    TempFile temp(path);
    temp.release();
    test_stop_point("atomic-write-begin:" + temp.base_name());
    write(temp.path());
    temp.commit();
}

}  // namespace linvis::io
