// The Mooncake trace reader (trace_file.h) of the trace benchmark: valid lines, dense renumbering,
// and malformed input rejected with the file and line rather than crashing or misreading.
#include "bench/cache/trace_file.h"

#include <gtest/gtest.h>

#include <sstream>
#include <string>

namespace gdkv::cache {
namespace {

TEST(MooncakeTrace, ParsesRequestsAndRenumbersBlocks) {
  std::istringstream in(
      "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 6, \"hash_ids\": [7, 9]}\n"
      "\n"
      "  {\"hash_ids\":[9,7,18446744073709551615],\"timestamp\":12.5,\"extra\":{\"a\":[1,\"x\\\"\","
      "null,true,false,-2.5e3]}}\r\n"
      "{\"timestamp\": 3, \"hash_ids\": []}");
  const BlockTrace t = read_mooncake_trace(in, "t.jsonl");
  EXPECT_EQ(t.requests(), 3u);
  EXPECT_EQ(t.unique_blocks, 3u);
  EXPECT_EQ(t.refs, (std::vector<uint64_t>{0, 1, 1, 0, 2}));
  EXPECT_EQ(t.starts, (std::vector<uint64_t>{0, 2, 5, 5}));

  TraceRequest r;
  std::string error;
  ASSERT_TRUE(parse_mooncake_line("{\"timestamp\": 1e3, \"hash_ids\": [0]}", &r, &error));
  EXPECT_EQ(r.timestamp, 1000.0);
  EXPECT_EQ(r.hash_ids, (std::vector<uint64_t>{0}));
}

// Each malformed line, on line 2 after a good one: an error naming the file and line.
TEST(MooncakeTrace, RejectsMalformedLinesWithFileAndLine) {
  const char* good = "{\"timestamp\": 0, \"hash_ids\": [1, 2]}\n";
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{\"timestamp\": 0, \"hash_ids\": [1, 2]", "expected '}'"},  // truncated
      {"{\"timestamp\": 0, \"hash_ids\": [1, 2,]}", "expected a number"},
      {"{\"timestamp\": 0 \"hash_ids\": [1]}", "expected '}'"},
      {"{timestamp: 0, \"hash_ids\": [1]}", "expected a string"},
      {"[1, 2, 3]", "expected '{'"},
      {"not json", "expected '{'"},
      {"{\"timestamp\": 0, \"hash_ids\": [1]} {}", "text after the object"},
      {"{\"timestamp\": 0, \"hash_ids\": [1], \"x\": tru}", "expected a JSON value"},
      {"{\"timestamp\": 0, \"hash_ids\": [1], \"x\": \"abc}", "unterminated string"},
      {"{\"timestamp\": 0, \"hash_ids\": [01]}", "leading zero"},
      {"{\"timestamp\": 0}", "missing member \"hash_ids\""},
      {"{\"hash_ids\": [1]}", "missing member \"timestamp\""},
      {"{}", "missing member \"hash_ids\""},
      {"{\"timestamp\": 0, \"hash_ids\": 5}", "expected '['"},
      {"{\"timestamp\": \"0\", \"hash_ids\": [1]}", "expected a number"},
      {"{\"timestamp\": 0, \"hash_ids\": [1], \"hash_ids\": [2]}", "duplicate member"},
      {"{\"timestamp\": 0, \"hash_ids\": [18446744073709551616]}", "out of range"},
      {"{\"timestamp\": 0, \"hash_ids\": [99999999999999999999999999999999]}", "out of range"},
      {"{\"timestamp\": 0, \"hash_ids\": [-1]}", "must be an integer"},
      {"{\"timestamp\": 0, \"hash_ids\": [1.5]}", "must be an integer"},
      {"{\"timestamp\": 0, \"hash_ids\": [1e3]}", "must be an integer"},
      {"{\"timestamp\": 1e400, \"hash_ids\": [1]}", "timestamp out of range"},
      {"{\"timestamp\": 0, \"input_length\": -5, \"hash_ids\": [1]}", "must be an integer"},
      {"{\"timestamp\": 0, \"hash_ids\": [1], \"x\": " + std::string(200, '[') +
           std::string(200, ']') + "}",
       "nested too deeply"},
  };
  for (const auto& [line, what] : bad) {
    SCOPED_TRACE(line);
    std::istringstream in(good + line + "\n" + good);
    try {
      read_mooncake_trace(in, "bad.jsonl");
      ADD_FAILURE() << "accepted";
    } catch (const std::runtime_error& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind("bad.jsonl:2: ", 0), 0u) << msg;
      EXPECT_NE(msg.find(what), std::string::npos) << msg;
    }
  }
}

TEST(MooncakeTrace, RejectsEmptyAndMissingFiles) {
  for (const char* text : {"", "\n\n  \n"}) {
    std::istringstream in(text);
    EXPECT_THROW(
        {
          try {
            read_mooncake_trace(in, "empty.jsonl");
          } catch (const std::runtime_error& e) {
            EXPECT_STREQ(e.what(), "empty.jsonl: no requests (empty trace)");
            throw;
          }
        },
        std::runtime_error);
  }
  EXPECT_THROW(read_mooncake_trace("/nonexistent/trace.jsonl"), std::runtime_error);
}

}  // namespace
}  // namespace gdkv::cache
