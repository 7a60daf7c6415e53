#pragma once

// ferry-bench's outputs: the table on stdout, --json, --csv and --png.

#include <cstdio>
#include <string>
#include <vector>

#include "bench/ferry_bench/initiator.hpp"

namespace ferry_bench {

/// cores, CPU model, kernel, memory, host name.
json host_facts();

/// One line for the progress on stderr: "tcp WRITE 4K x1 inflight 1".
std::string describe(const PointResult& r);

void print_table(std::FILE* out, const std::vector<PointResult>& results);
/// Throw std::runtime_error when the file cannot be written.
void write_json(const std::string& path, const std::string& command,
                const std::vector<PointResult>& results, const json& stats);
void write_csv(const std::string& path, const std::vector<PointResult>& results);
/// Bandwidth against block size (log x), one line per method x op_type x inflight (and batch
/// size, threads and pairing where they vary), drawn by gnuplot. Returns why no PNG was
/// written (gnuplot missing, or failing), or an empty string.
std::string write_png(const std::string& path, const std::vector<PointResult>& results);

}  // namespace ferry_bench
