// Config: a full DeepSpeed document, defaults, DeepSpeed semantics (Adam is
// AdamW unless adam_w_mode is false, loss_scale 0 is dynamic), every kind of
// error naming its key, ignored keys, cross-field validation, and the
// ConfigToJson round trip.
#include "offload/config.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/log.h"
#include "runtime/units.h"

namespace strata {
namespace {

bool Contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

Status ParseError(std::string_view json) {
  Result<OffloadConfig> c = ParseConfigJson(json);
  EXPECT_FALSE(c.ok()) << json;
  return c.ok() ? OkStatus() : c.status();
}

TEST(ConfigTest, FullDeepSpeedDocument) {
  Result<OffloadConfig> c = ParseConfigJson(R"({
    "train_batch_size": 64,
    "zero_optimization": {
      "stage": 3, "sub_group_size": 1e8, "overlap_comm": true,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
                            "buffer_count": 5, "fast_init": false, "ratio": 1.0}},
    "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 2,
            "single_submit": true, "overlap_events": false, "use_gds": false},
    "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6,
                                             "weight_decay": 0.1, "adam_w_mode": false}},
    "gradient_clipping": 0.5,
    "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 12,
             "loss_scale_window": 500, "hysteresis": 3, "min_loss_scale": 4},
    "strata": {"host_budget": "64GiB", "device_budget": 1073741824, "threads": 8}
  })");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->zero_stage, 3);
  EXPECT_EQ(c->sub_group_elems, 100'000'000u);
  EXPECT_EQ(c->device, OffloadDevice::kNvme);
  EXPECT_EQ(c->nvme_paths, std::vector<std::string>{"/local_nvme"});
  EXPECT_EQ(c->buffer_count, 5u);
  EXPECT_EQ(c->aio.block_bytes, 262144u);
  EXPECT_EQ(c->aio.queue_depth, 32u);
  EXPECT_EQ(c->aio.thread_count, 2u);
  EXPECT_EQ(c->aio.single_submit, Switch::kOn);
  EXPECT_EQ(c->aio.overlap_events, Switch::kOff);
  EXPECT_EQ(c->optimizer, OptimizerType::kAdam);
  EXPECT_EQ(c->adam.lr, 3e-4);
  EXPECT_EQ(c->adam.beta1, 0.8);
  EXPECT_EQ(c->adam.beta2, 0.95);
  EXPECT_EQ(c->adam.eps, 1e-6);
  EXPECT_EQ(c->adam.weight_decay, 0.1);
  EXPECT_EQ(c->adam.weight_decay_mode, WeightDecayMode::kL2);
  EXPECT_EQ(c->max_grad_norm, 0.5);
  EXPECT_EQ(c->param_dtype, DType::kF16);
  EXPECT_EQ(c->grad_dtype, DType::kF16);
  EXPECT_EQ(c->loss_scaler.mode, LossScaleMode::kDynamic);
  EXPECT_EQ(c->loss_scaler.initial_scale_power, 12);
  EXPECT_EQ(c->loss_scaler.growth_interval, 500u);
  EXPECT_EQ(c->loss_scaler.hysteresis, 3u);
  EXPECT_EQ(c->loss_scaler.min_scale, 4.0);
  EXPECT_EQ(c->host_budget_bytes, 64 * kGiB);
  EXPECT_EQ(c->device_budget_bytes, kGiB);
  EXPECT_EQ(c->threads, 8);
  EXPECT_TRUE(ValidateConfig(*c).ok()) << ValidateConfig(*c);
}

TEST(ConfigTest, EmptyDocumentGivesDefaults) {
  Result<OffloadConfig> c = ParseConfigJson("{}");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->device, OffloadDevice::kCpu);
  EXPECT_EQ(c->buffer_count, 4u);
  EXPECT_EQ(c->aio.block_bytes, kMiB);
  EXPECT_EQ(c->aio.queue_depth, 8u);
  EXPECT_EQ(c->sub_group_elems, 1'000'000'000u);
  EXPECT_EQ(c->max_grad_norm, 1.0);
  EXPECT_EQ(c->optimizer, OptimizerType::kAdamW);
  EXPECT_EQ(c->loss_scaler.mode, LossScaleMode::kNone);
  EXPECT_EQ(c->param_dtype, DType::kF32);
  EXPECT_TRUE(ValidateConfig(*c).ok());
}

TEST(ConfigTest, DeepSpeedSemantics) {
  // Adam defaults to decoupled decay (adam_w_mode true), as DeepSpeed's
  // engine builds it: AdamW, which is what the update and checkpoints follow.
  // Only adam_w_mode false keeps L2 decay.
  for (const char* doc : {R"({"optimizer": {"type": "adam"}})",
                          R"({"optimizer": {"type": "Adam", "params": {"weight_decay": 0.1}}})",
                          R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": true}}})"}) {
    SCOPED_TRACE(doc);
    Result<OffloadConfig> adam = ParseConfigJson(doc);
    ASSERT_TRUE(adam.ok()) << adam.status();
    EXPECT_EQ(adam->adam.weight_decay_mode, WeightDecayMode::kDecoupled);
    EXPECT_EQ(adam->optimizer, OptimizerType::kAdamW);
    EXPECT_TRUE(Contains(ConfigToJson(*adam), R"("type": "AdamW")")) << ConfigToJson(*adam);
    EXPECT_TRUE(Contains(ConfigToJson(*adam), R"("adam_w_mode": true)")) << ConfigToJson(*adam);
  }
  Result<OffloadConfig> l2 = ParseConfigJson(
      R"({"optimizer": {"type": "Adam", "params": {"weight_decay": 0.1, "adam_w_mode": false}}})");
  ASSERT_TRUE(l2.ok()) << l2.status();
  EXPECT_EQ(l2->optimizer, OptimizerType::kAdam);
  EXPECT_TRUE(Contains(ConfigToJson(*l2), R"("adam_w_mode": false)")) << ConfigToJson(*l2);
  // loss_scale > 0 is static.
  Result<OffloadConfig> st = ParseConfigJson(R"({"fp16": {"enabled": true, "loss_scale": 128}})");
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->loss_scaler.mode, LossScaleMode::kStatic);
  EXPECT_EQ(st->loss_scaler.static_scale, 128.0);
  // bf16: no loss scaling.
  Result<OffloadConfig> bf = ParseConfigJson(R"({"bf16": {"enabled": true}})");
  ASSERT_TRUE(bf.ok());
  EXPECT_EQ(bf->param_dtype, DType::kBF16);
  EXPECT_EQ(bf->loss_scaler.mode, LossScaleMode::kNone);
  // Several NVMe paths are striped; the strata section overrides the grad dtype.
  Result<OffloadConfig> multi = ParseConfigJson(R"({
    "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": ["/a", "/b"]}},
    "bf16": {"enabled": true}, "strata": {"grad_dtype": "fp32"}})");
  ASSERT_TRUE(multi.ok()) << multi.status();
  EXPECT_EQ(multi->nvme_paths, (std::vector<std::string>{"/a", "/b"}));
  EXPECT_EQ(multi->grad_dtype, DType::kF32);
  // Adagrad and Lion parameters.
  Result<OffloadConfig> lion = ParseConfigJson(
      R"({"optimizer": {"type": "Lion", "params": {"lr": 1e-5, "betas": [0.9, 0.98]}}})");
  ASSERT_TRUE(lion.ok());
  EXPECT_EQ(lion->lion.lr, 1e-5);
  EXPECT_EQ(lion->lion.beta2, 0.98);
  EXPECT_EQ(StateBytesPerElem(lion->optimizer), 8u);
  Result<OffloadConfig> ada = ParseConfigJson(
      R"({"optimizer": {"type": "Adagrad", "params": {"lr": 0.1, "lr_decay": 0.01}}})");
  ASSERT_TRUE(ada.ok());
  EXPECT_EQ(ada->adagrad.lr_decay, 0.01);
}

TEST(ConfigTest, UnknownKeysNameThePathAndSuggest) {
  Status s = ParseError(R"({"zero_optimization": {"offload_optimizer": {"nvme_pth": "/x"}}})");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "zero_optimization.offload_optimizer.nvme_pth: unknown key (did you mean nvme_path?)");
  s = ParseError(R"({"aio": {"queue_dpth": 4}})");
  EXPECT_TRUE(Contains(s.message(), "aio.queue_dpth: unknown key (did you mean queue_depth?)"))
      << s;
  s = ParseError(R"({"zero_optimization": {"overlap_com": true}})");
  EXPECT_TRUE(Contains(s.message(), "overlap_com: unknown key (did you mean overlap_comm?)")) << s;
  s = ParseError(R"({"zzz": 1})");
  EXPECT_TRUE(Contains(s.message(), "zzz: unknown key (known keys here:")) << s;
  // Keys valid for one optimizer are unknown for another.
  s = ParseError(R"({"optimizer": {"type": "Lion", "params": {"eps": 1e-8}}})");
  EXPECT_TRUE(Contains(s.message(), "optimizer.params.eps: unknown key")) << s;
}

TEST(ConfigTest, IgnoredDeepSpeedKeysAreAccepted) {
  Result<OffloadConfig> c = ParseConfigJson(R"({
    "train_micro_batch_size_per_gpu": 4, "scheduler": {"type": "WarmupLR", "params": {}},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                          "stage3_max_live_parameters": 1e9, "contiguous_gradients": true},
    "optimizer": {"type": "AdamW", "params": {"torch_adam": true}},
    "fp16": {"enabled": false, "auto_cast": false}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(IgnoredConfigKeys().empty());
}

// Ignored keys whose DeepSpeed meaning changes the training warn, at every
// config that holds them, with what to do; the others stay an info line.
TEST(ConfigTest, IgnoredKeysThatChangeTrainingWarnEveryTime) {
  std::vector<std::pair<LogLevel, std::string>> lines;
  const LogLevel level = GetLogLevel();
  SetLogLevel(LogLevel::kInfo);
  LogSink previous = SetLogSink(
      [&](LogLevel l, std::string_view message) { lines.emplace_back(l, std::string(message)); });
  const char* doc = R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
                        "gradient_accumulation_steps": 4, "tensorboard": {"enabled": true}})";
  const bool first = ParseConfigJson(doc).ok();
  const bool second = ParseConfigJson(doc).ok();
  const bool one_step = ParseConfigJson(R"({"gradient_accumulation_steps": 1})").ok();
  SetLogSink(std::move(previous));
  SetLogLevel(level);
  ASSERT_TRUE(first && second && one_step);
  size_t scheduler = 0, accumulation = 0;
  for (const auto& [l, m] : lines) {
    if (Contains(m, "scheduler (WarmupLR) is not applied")) {
      EXPECT_EQ(l, LogLevel::kWarning) << m;
      EXPECT_TRUE(Contains(m, "torch.optim.lr_scheduler")) << m;
      ++scheduler;
    }
    if (Contains(m, "gradient_accumulation_steps = 4 is not applied")) {
      EXPECT_EQ(l, LogLevel::kWarning) << m;
      EXPECT_TRUE(Contains(m, "Divide the loss by the number of micro-steps")) << m;
      ++accumulation;
    }
    EXPECT_FALSE(Contains(m, "gradient_accumulation_steps = 1")) << m;
    if (Contains(m, "tensorboard")) {
      EXPECT_EQ(l, LogLevel::kInfo) << m;
    }
  }
  EXPECT_EQ(scheduler, 2u) << ::testing::PrintToString(lines);
  EXPECT_EQ(accumulation, 2u) << ::testing::PrintToString(lines);
}

// DeepSpeed keys whose meaning Strata cannot honour are refused as such,
// with what DeepSpeed does and what to write, not as typos; a value that
// switches the feature off is accepted.
TEST(ConfigTest, DeepSpeedKeysStrataCannotHonourAreRefusedWithTheirMeaning) {
  const std::pair<std::string_view, std::string_view> refused[] = {
      {R"({"bfloat16": {"enabled": true}})", "bfloat16: a DeepSpeed key Strata does not support"},
      {R"({"bfloat16": {"enabled": true}})", "rename it to bf16"},
      {R"({"torch_autocast": {"enabled": true, "dtype": "bfloat16"}})",
       "wrap it in torch.autocast"},
      {R"({"gradient_allreduce_op": "sum"})", "multiply the loss by the world size"},
      {R"({"tensor_parallel": {"autotp_size": 2}})", "tensor_parallel: a DeepSpeed key"},
      {R"({"progressive_layer_drop": {"enabled": true, "theta": 0.5}})", "layer-drop"},
      {R"({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}})",
       "optimizer.params.max_grad_norm: a DeepSpeed key Strata does not support; DeepSpeed "
       "refuses it too and clips by the top-level gradient_clipping"},
  };
  for (const auto& [json, want] : refused) {
    Status s = ParseError(json);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << json;
    EXPECT_TRUE(Contains(s.message(), want)) << json << " -> " << s;
    EXPECT_FALSE(Contains(s.message(), "unknown key")) << s;
  }
  for (std::string_view off : {R"({"bfloat16": {"enabled": false}})",
                               R"({"torch_autocast": {"enabled": false}})",
                               R"({"gradient_allreduce_op": "MEAN"})",
                               R"({"curriculum_learning": {"enabled": false}})"}) {
    Result<OffloadConfig> c = ParseConfigJson(off);
    EXPECT_TRUE(c.ok()) << off << " -> " << c.status();
  }
}

// Harmless DeepSpeed keys are ignored, and an unknown key's hints neither
// point from a real DeepSpeed key to another nor read as "the ignored
// DeepSpeed keys are refused too".
TEST(ConfigTest, HarmlessDeepSpeedKeysAreIgnoredAndHintsDoNotMislead) {
  Result<OffloadConfig> c = ParseConfigJson(R"({
    "hybrid_engine": {"enabled": true, "max_out_tokens": 512}, "compile": {"deepcompile": true},
    "sparse_attention": {"mode": "fixed"}, "dataloader_drop_last": true,
    "seq_parallel_comm_data_type": "fp32",
    "zero_optimization": {"stage": 3, "stage3_model_persistence_threshold": 1e6,
                          "stage3_module_granularity_threshold": 0},
    "bf16": {"enabled": true, "bf16_master_weights_and_grads": false}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->param_dtype, DType::kBF16);
  Status s = ParseError(R"({"zero_optimization": {"stage3_model_persistance_threshold": 1}})");
  EXPECT_TRUE(Contains(s.message(), "did you mean stage3_model_persistence_threshold?")) << s;
  s = ParseError(R"({"zero_optimization": {"qqqqqqqqqqqq": 1}})");
  EXPECT_TRUE(Contains(s.message(),
                       "(known keys here: stage, sub_group_size, offload_optimizer; and "))
      << s;
  EXPECT_TRUE(Contains(s.message(), "DeepSpeed keys accepted and ignored")) << s;
}

// Values DeepSpeed takes with a meaning Strata cannot honour say that meaning
// and what to write instead.
TEST(ConfigTest, DeepSpeedValuesStrataRefusesSayWhatDeepSpeedMeant) {
  Status s = ParseError(R"({"zero_optimization": {"stage": 3, "sub_group_size": 0}})");
  EXPECT_TRUE(Contains(s.message(), "zero_optimization.sub_group_size = 0: must be")) << s;
  EXPECT_TRUE(Contains(s.message(), "DeepSpeed's 0 (read in stage 3 only) puts each parameter "
                                    "in a sub-group of its own"))
      << s;
  EXPECT_TRUE(Contains(s.message(), "or \"auto\"")) << s;
  s = ParseError(R"({"fp16": {"enabled": true, "min_loss_scale": 0.0}})");
  EXPECT_TRUE(Contains(s.message(), "fp16.min_loss_scale = 0.0: must be")) << s;
  EXPECT_TRUE(Contains(s.message(), "DeepSpeed reads 0 as no floor")) << s;
  // Other bad values keep the plain message.
  s = ParseError(R"({"fp16": {"min_loss_scale": -1}})");
  EXPECT_FALSE(Contains(s.message(), "DeepSpeed")) << s;
}

// A Hugging Face config's "auto" values are named in one error, not one per
// run; "auto" where a key takes it or in an ignored section is not named.
TEST(ConfigTest, EveryAutoIsNamedInOneError) {
  Status s = ParseError(R"({
    "fp16": {"enabled": "auto", "loss_scale": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": 1e-8}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}},
    "zero_optimization": {"sub_group_size": "auto", "reduce_bucket_size": "auto"},
    "gradient_clipping": "auto", "train_batch_size": "auto"})");
  EXPECT_EQ(s.message(),
            "config: 4 values are \"auto\", which the Hugging Face integration fills in "
            "(strata.torch.OffloadAdam fills the optimizer's, the clipping and fp16/bf16 from "
            "its arguments); give each a value: "
            "fp16.enabled, gradient_clipping, optimizer.params.betas, optimizer.params.lr");
  // One "auto" keeps its own message, with the type it needs.
  s = ParseError(R"({"aio": {"queue_depth": "auto"}, "scheduler": {"params": {"x": "auto"}}})");
  EXPECT_TRUE(Contains(s.message(), "aio.queue_depth = \"auto\": expected an integer")) << s;
  // An error that is not an "auto" one is not replaced by the list.
  s = ParseError(R"({"gradient_cliping": 1.0, "optimizer": {"params": {"lr": "auto",
                                                                       "eps": "auto"}}})");
  EXPECT_TRUE(Contains(s.message(), "did you mean gradient_clipping")) << s;
}

// pin_memory false is not honoured (the engine always page-locks its host
// buffers): a warning says so, and the effective config says true.
TEST(ConfigTest, PinMemoryFalseIsIgnoredWithAWarning) {
  std::vector<std::pair<LogLevel, std::string>> lines;
  LogSink previous = SetLogSink(
      [&](LogLevel l, std::string_view message) { lines.emplace_back(l, std::string(message)); });
  Result<OffloadConfig> c =
      ParseConfigJson(R"({"zero_optimization": {"offload_optimizer": {"pin_memory": false}}})");
  SetLogSink(std::move(previous));
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(lines.size(), 1u) << ::testing::PrintToString(lines);
  EXPECT_EQ(lines[0].first, LogLevel::kWarning);
  EXPECT_TRUE(Contains(lines[0].second, "pin_memory = false is ignored")) << lines[0].second;
  EXPECT_TRUE(Contains(ConfigToJson(*c), R"("pin_memory": true)")) << ConfigToJson(*c);
}

// docs/config.md lists every ignored key by its full path.
TEST(ConfigTest, TheDocsListEveryIgnoredKey) {
  std::ifstream in(std::string(STRATA_SOURCE_DIR) + "/docs/config.md");
  ASSERT_TRUE(in) << STRATA_SOURCE_DIR << "/docs/config.md";
  std::stringstream docs;
  docs << in.rdbuf();
  for (std::string_view key : IgnoredConfigKeys()) {
    EXPECT_TRUE(Contains(docs.str(), "`" + std::string(key) + "`")) << key;
  }
}

// A size the parser cannot read says why (it gave only "expected a byte
// count"); "auto" keeps its hint.
TEST(ConfigTest, AByteSizeThatDoesNotParseSaysWhy) {
  Status s = ParseError(R"({"strata": {"host_budget": "64GiBs"}})");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s.message(), "strata.host_budget = \"64GiBs\": expected a byte count"))
      << s;
  EXPECT_TRUE(Contains(s.message(), "unknown suffix 'GiBs'")) << s;
  s = ParseError(R"({"strata": {"host_budget": "auto"}})");
  EXPECT_TRUE(Contains(s.message(), "filled in by the Hugging Face integration")) << s;
}

TEST(ConfigTest, WrongTypesAndRangesNameKeyValueAndRange) {
  struct Case {
    std::string_view json;
    std::string_view want;
  };
  const Case cases[] = {
      {R"({"aio": {"queue_depth": 0}})", "aio.queue_depth = 0: must be an integer in [1, 4096]"},
      {R"({"aio": {"queue_depth": "8"}})", "aio.queue_depth = \"8\": expected an integer"},
      {R"({"aio": {"queue_depth": 2.5}})", "aio.queue_depth = 2.5: must be an integer"},
      {R"({"aio": {"block_size": "lots"}})", "aio.block_size = \"lots\": expected a byte count"},
      {R"({"zero_optimization": {"stage": 4}})", "zero_optimization.stage = 4: must be"},
      {R"({"zero_optimization": {"stage": "auto"}})", "filled in by the Hugging Face"},
      {R"({"zero_optimization": {"sub_group_size": "lots"}})",
       "sub_group_size = \"lots\": expected an integer"},
      {R"({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}})",
       "device = \"gpu\": must be \"cpu\", \"nvme\" or \"none\""},
      {R"({"zero_optimization": {"offload_optimizer": {"pin_memory": 1}}})",
       "pin_memory = 1: expected true or false"},
      {R"({"zero_optimization": []})", "zero_optimization = []: expected an object"},
      {R"({"optimizer": {"type": "Lamb"}})", "optimizer.type = \"Lamb\": unsupported"},
      {R"({"optimizer": {"params": {"betas": [0.9, 1.0]}}})", "each beta must be in [0, 1)"},
      {R"({"optimizer": {"params": {"betas": [0.9]}}})", "two numbers"},
      {R"({"optimizer": {"params": {"eps": 0}}})",
       "optimizer.params.eps = 0: must be a number in (0"},
      {R"({"optimizer": {"params": {"amsgrad": true}}})", "AMSGrad is not supported"},
      {R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})", "contradicts"},
      {R"({"gradient_clipping": -1})", "gradient_clipping = -1: must be a number in [0"},
      {R"({"fp16": {"initial_scale_power": 300}})", "fp16.initial_scale_power = 300"},
      {R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})", "both true"},
      {R"({"strata": {"grad_dtype": "int8"}})", "strata.grad_dtype = \"int8\""},
      {R"({"strata": {"host_budget": -1}})", "strata.host_budget = -1"},
      {R"([1, 2])", "expected a JSON object"},
      {R"({"aio": )", "parse config JSON"},
  };
  for (const Case& c : cases) {
    Status s = ParseError(c.json);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.json;
    EXPECT_TRUE(Contains(s.message(), c.want)) << c.json << " -> " << s;
  }
}

TEST(ConfigTest, ValidateCrossFieldChecks) {
  struct Case {
    std::string_view json;
    std::string_view want;
  };
  const Case cases[] = {
      {R"({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})",
       "nvme_path is not set"},
      {R"({"zero_optimization": {"offload_optimizer": {"device": "none"}}})", "always offloads"},
      {R"({"zero_optimization": {"stage": 0}})", "ZeRO stage 1, 2 or 3"},
      {R"({"optimizer": {"type": "Lion"}, "strata": {"gpu_fraction": 0.5}})",
       "needs optimizer Adam or AdamW"},
      {R"({"strata": {"gpu_fraction": "auto"}})", "needs strata.device_budget"},
      {R"({"aio": {"block_size": 5000}})", "multiple of 4096"},
      {R"({"fp16": {"enabled": true, "initial_scale_power": 1, "min_loss_scale": 4}})",
       "fp16: loss scaler: initial scale"},
      {R"({"zero_optimization": {"offload_optimizer": {"device": "nvme",
            "nvme_path": ["/a", "/b", "/a/"]}}})",
       "nvme_path: '/a/' is listed twice (entries 0 and 2)"},
      // No shell expands it: a directory named "~" under the working directory.
      {R"({"zero_optimization": {"offload_optimizer": {"device": "nvme",
            "nvme_path": ["/a", "~/nvme"]}}})",
       "nvme_path: '~/nvme' starts with ~, which nothing expands here (no shell reads the "
       "config): give the whole path ("},
  };
  for (const Case& c : cases) {
    Result<OffloadConfig> cfg = ParseConfigJson(c.json);
    ASSERT_TRUE(cfg.ok()) << c.json << " " << cfg.status();
    Status s = ValidateConfig(*cfg);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.json;
    EXPECT_TRUE(Contains(s.message(), c.want)) << c.json << " -> " << s;
  }
}

// An nvme_path with device "cpu" is said once per config: the Python module
// and the C API validate a config and Create validates it again, and the
// line was logged by each ValidateConfig (twice for one OffloadAdam).
TEST(ConfigTest, AnUnusedNvmePathIsLoggedOnceByTheParser) {
  std::vector<std::string> lines;
  const LogLevel level = GetLogLevel();
  SetLogLevel(LogLevel::kInfo);
  LogSink previous =
      SetLogSink([&](LogLevel, std::string_view message) { lines.emplace_back(message); });
  Result<OffloadConfig> c = ParseConfigJson(
      R"({"zero_optimization": {"offload_optimizer": {"device": "cpu", "nvme_path": "/x"}}})");
  const Status first = c.ok() ? ValidateConfig(*c) : c.status();
  const Status second = c.ok() ? ValidateConfig(*c) : c.status();
  SetLogSink(std::move(previous));
  SetLogLevel(level);
  ASSERT_TRUE(first.ok()) << first;
  ASSERT_TRUE(second.ok()) << second;
  size_t said = 0;
  for (const std::string& l : lines) {
    said += Contains(l, "offload_optimizer.nvme_path is unused with device \"cpu\"");
  }
  EXPECT_EQ(said, 1u) << ::testing::PrintToString(lines);
}

TEST(ConfigTest, GpuFractionAndDeepSpeedsRatioSayTheSameThing) {
  Result<OffloadConfig> c = ParseConfigJson(R"({"strata": {"gpu_fraction": 0.25}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->gpu_fraction, 0.25);
  c = ParseConfigJson(R"({"zero_optimization": {"offload_optimizer": {"ratio": 0.75}}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->gpu_fraction, 0.25);
  EXPECT_TRUE(ValidateConfig(*c).ok());
  c = ParseConfigJson(R"({"zero_optimization": {"offload_optimizer": {"ratio": 0.75}},
                          "strata": {"gpu_fraction": 0.25}})");
  ASSERT_TRUE(c.ok()) << c.status();
  c = ParseConfigJson(R"({"zero_optimization": {"offload_optimizer": {"ratio": 0.5}},
                          "strata": {"gpu_fraction": 0.25}})");
  ASSERT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(c.status().message(), "contradicts")) << c.status();
  // Also where the ratio means gpu_fraction 0 (it was taken), and against "auto".
  for (const char* both : {R"({"zero_optimization": {"offload_optimizer": {"ratio": 1.0}},
                               "strata": {"gpu_fraction": 0.5}})",
                           R"({"zero_optimization": {"offload_optimizer": {"ratio": 0.5}},
                               "strata": {"gpu_fraction": "auto"}})"}) {
    c = ParseConfigJson(both);
    ASSERT_EQ(c.status().code(), StatusCode::kInvalidArgument) << both;
    EXPECT_TRUE(Contains(c.status().message(), "contradicts")) << c.status();
  }
  c = ParseConfigJson(R"({"zero_optimization": {"offload_optimizer": {"ratio": 1}},
                          "strata": {"gpu_fraction": 0}})");
  ASSERT_TRUE(c.ok()) << c.status();
  c = ParseConfigJson(R"({"strata": {"gpu_fraction": "AUTO", "device_budget": "60GiB"}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->gpu_fraction, kGpuFractionAuto);
  EXPECT_TRUE(ValidateConfig(*c).ok());
  EXPECT_EQ(PlacementInputsFor(*c, std::vector<uint64_t>{10}).gpu_fraction, kGpuFractionAuto);
  // Round trip, "auto" included.
  Result<OffloadConfig> back = ParseConfigJson(ConfigToJson(*c));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->gpu_fraction, kGpuFractionAuto);
  for (const char* bad : {R"({"strata": {"gpu_fraction": 1.5}})",
                          R"({"strata": {"gpu_fraction": -0.1}})",
                          R"({"strata": {"gpu_fraction": "half"}})",
                          R"({"strata": {"gpu_fraction": true}})"}) {
    Result<OffloadConfig> r = ParseConfigJson(bad);
    ASSERT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(Contains(r.status().message(), "gpu_fraction")) << r.status();
  }
}

TEST(ConfigTest, RatesTakeNumbersCountsAndRatesAndNameWhatIsWrong) {
  Result<OffloadConfig> c = ParseConfigJson(R"({"strata": {"rates": {
      "cpu_adam": "5.4G", "device_adam": 1e11, "pcie": "25GB/s", "nvme_read": "1.9 GB/s",
      "nvme_write": 3300000000}}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rates.cpu_adam_elems_per_sec, 5.4e9);
  EXPECT_EQ(c->rates.device_adam_elems_per_sec, 1e11);
  EXPECT_EQ(c->rates.pcie_bytes_per_sec, 25e9);
  EXPECT_EQ(c->rates.nvme_read_bytes_per_sec, 1.9e9);
  EXPECT_EQ(c->rates.nvme_write_bytes_per_sec, 3.3e9);
  const PlacementInputs in = PlacementInputsFor(*c, std::vector<uint64_t>{10});
  EXPECT_EQ(in.rates.pcie_bytes_per_sec, 25e9);
  Result<OffloadConfig> back = ParseConfigJson(ConfigToJson(*c));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->rates.nvme_read_bytes_per_sec, 1.9e9);
  EXPECT_EQ(back->rates.cpu_adam_elems_per_sec, 5.4e9);
  struct Bad {
    const char* json;
    const char* want;
  } bad[] = {
      {R"({"strata": {"rates": {"pcie": "fast"}}})", "strata.rates.pcie"},
      {R"({"strata": {"rates": {"cpu_adam": -1}}})", "strata.rates.cpu_adam"},
      {R"({"strata": {"rates": {"nvme_red": "1GB/s"}}})", "nvme_read"},
      {R"({"strata": {"rates": 5}})", "strata.rates"},
      {R"({"strata": {"rates": {"device_adam": true}}})", "strata.rates.device_adam"},
  };
  for (const Bad& b : bad) {
    Result<OffloadConfig> r = ParseConfigJson(b.json);
    ASSERT_EQ(r.status().code(), StatusCode::kInvalidArgument) << b.json;
    EXPECT_TRUE(Contains(r.status().message(), b.want)) << b.json << " -> " << r.status();
  }
}

// A number beyond a double (1e400) is a Status naming the key, never an
// exception: the parser's out_of_range once escaped and aborted the caller.
// An error names a deeply nested value without walking all of it (the stack
// overflowed at 100k levels), and a long one (or a long number) cut short.
TEST(ConfigTest, DeeplyNestedValuesAreRefusedWithoutOverflowingTheStack) {
  const std::string deep = std::string(200'000, '[') + std::string(200'000, ']');
  Status s = ParseError(R"({"optimizer": {"params": {"betas": )" + deep + "}}}");
  EXPECT_TRUE(Contains(s.message(), "optimizer.params.betas = [[[[[[[[[[[[[[[[[...]]]]]]]]]]]]]]]]]: "
                                    "expected two numbers"))
      << s;
  s = ParseError(R"({"optimizer": {"params": {"lr": "auto", "eps": "auto", "betas": )" + deep +
                 "}}}");
  EXPECT_TRUE(Contains(s.message(), "2 values are \"auto\"")) << s;
  s = ParseError("[" + deep + "]");
  EXPECT_TRUE(Contains(s.message(), "config = [[[[")) << s;
  std::string wide = "[1";
  for (int i = 0; i < 100'000; ++i) wide += ",1";
  s = ParseError(R"({"aio": {"queue_depth": )" + wide + "]}}");
  EXPECT_TRUE(Contains(s.message(), "aio.queue_depth = [1,1,1,1,1,")) << s;
  EXPECT_TRUE(Contains(s.message(), "...: expected an integer")) << s;
  EXPECT_LT(s.message().size(), 200u) << s;
  // A number beyond a double is cut short too.
  s = ParseError(R"({"optimizer": {"params": {"lr": 1)" + std::string(100'000, '0') + "}}}");
  EXPECT_TRUE(Contains(s.message(), "optimizer.params.lr = 1000")) << s;
  EXPECT_TRUE(Contains(s.message(), "beyond the range of a double")) << s;
  EXPECT_LT(s.message().size(), 300u) << s;
}

TEST(ConfigTest, NumbersBeyondADoubleNameTheKeyAndDoNotThrow) {
  struct Case {
    std::string_view json;
    std::string_view want;
  };
  const Case cases[] = {
      {R"({"optimizer": {"params": {"lr": 1e400}}})", "optimizer.params.lr = 1e400"},
      {R"({"zero_optimization": {"sub_group_size": 1e400}})",
       "zero_optimization.sub_group_size = 1e400"},
      {R"({"optimizer": {"params": {"betas": [0.9, -2E+999]}}})",
       "optimizer.params.betas[1] = -2E+999"},
      {R"({"strata": {"rates": {"pcie": 1e309}}, "aio": {}})", "strata.rates.pcie = 1e309"},
      {"1e400", "the document = 1e400"},
  };
  for (const Case& c : cases) {
    // An exception here fails the test (gtest catches it) rather than passing.
    Result<OffloadConfig> r = ParseConfigJson(c.json);
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << c.json;
    EXPECT_TRUE(Contains(r.status().message(), c.want)) << c.json << " -> " << r.status();
    EXPECT_TRUE(Contains(r.status().message(), "beyond the range of a double"))
        << r.status();
  }
  // A syntax error names where it happened too.
  Status s = ParseError(R"({"aio": {"queue_depth": 8,}})");
  EXPECT_TRUE(Contains(s.message(), "parse config JSON in aio:")) << s;
}

// A repeated key would keep only its last value (nlohmann's DOM does), so a
// setting could vanish unseen: it is refused, naming the key's path. The same
// key in different objects is fine.
TEST(ConfigTest, RepeatedKeysAreRefusedNamingThePath) {
  const std::pair<std::string_view, std::string_view> cases[] = {
      {R"({"gradient_clipping": 1.0, "gradient_clipping": 0})", "the key gradient_clipping "},
      {R"({"zero_optimization": {"stage": 3, "sub_group_size": 8, "stage": 2}})",
       "the key zero_optimization.stage "},
      {R"({"optimizer": {"params": {"betas": [0.9, 0.99], "lr": 1, "lr": 2}}})",
       "the key optimizer.params.lr "},
  };
  for (const auto& [json, want] : cases) {
    Status s = ParseError(json);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << json;
    EXPECT_TRUE(Contains(s.message(), want)) << json << " -> " << s;
    EXPECT_TRUE(Contains(s.message(), "appears more than once")) << s;
  }
  Result<OffloadConfig> ok = ParseConfigJson(
      R"({"fp16": {"enabled": false}, "bf16": {"enabled": true},
          "optimizer": {"params": {"lr": 0.5}}, "strata": {"rates": {"pcie": "12G"}}})");
  ASSERT_TRUE(ok.ok()) << ok.status();
}

// A path that is not UTF-8 (set by code, not parsed) is written, not thrown on.
TEST(ConfigTest, ConfigToJsonWritesAPathThatIsNotUtf8) {
  OffloadConfig c;
  c.device = OffloadDevice::kNvme;
  c.nvme_paths = {"/tmp/bad\xff" "dir"};
  const std::string json = ConfigToJson(c);
  EXPECT_TRUE(Contains(json, "/tmp/bad\xef\xbf\xbd" "dir")) << json;  // U+FFFD
  EXPECT_TRUE(ParseConfigJson(json).ok());
}

TEST(ConfigTest, ConfigToJsonRoundTrips) {
  const std::string_view docs[] = {
      "{}",
      R"({"zero_optimization": {"stage": 3, "sub_group_size": 12345,
            "offload_optimizer": {"device": "nvme", "nvme_path": ["/a", "/b"], "buffer_count": 7}},
          "aio": {"block_size": "2MiB", "use_gds": true},
          "optimizer": {"type": "Adam", "params": {"lr": 0.1, "adam_w_mode": false,
                                                   "bias_correction": false}},
          "fp16": {"enabled": true, "loss_scale": 64, "consecutive_hysteresis": true},
          "strata": {"host_budget": "3GiB", "align_elems": 128, "min_scale_overflow": "skip"}})",
      R"({"optimizer": {"type": "Lion", "params": {"lr": 0.001, "weight_decay": 0.3}},
          "bf16": {"enabled": true}, "gradient_clipping": 0})",
      R"({"optimizer": {"type": "Adagrad", "params": {"eps": 1e-7}}})",
      R"({"zero_optimization": {"sub_group_size": "auto"}})",
  };
  for (std::string_view doc : docs) {
    Result<OffloadConfig> a = ParseConfigJson(doc);
    ASSERT_TRUE(a.ok()) << a.status();
    const std::string json = ConfigToJson(*a);
    Result<OffloadConfig> b = ParseConfigJson(json);
    ASSERT_TRUE(b.ok()) << b.status() << "\n" << json;
    EXPECT_EQ(ConfigToJson(*b), json);
    EXPECT_EQ(b->optimizer, a->optimizer);
    EXPECT_EQ(b->nvme_paths, a->nvme_paths);
    EXPECT_EQ(b->loss_scaler.mode, a->loss_scaler.mode);
    EXPECT_EQ(b->adam.weight_decay_mode, a->adam.weight_decay_mode);
    EXPECT_EQ(b->adam.bias_correction, a->adam.bias_correction);
    EXPECT_EQ(b->host_budget_bytes, a->host_budget_bytes);
    EXPECT_EQ(b->aio.block_bytes, a->aio.block_bytes);
    EXPECT_EQ(b->sub_group_elems, a->sub_group_elems);
  }
}

TEST(ConfigTest, SubGroupSizeAutoIsThePlannersChoiceForTheShard) {
  Result<OffloadConfig> fixed = ParseConfigJson(R"({"zero_optimization": {"sub_group_size": 7}})");
  ASSERT_TRUE(fixed.ok()) << fixed.status();
  EXPECT_EQ(SubGroupElemsFor(*fixed, 1'000'000'000), 7u);

  Result<OffloadConfig> c = ParseConfigJson(R"({
    "zero_optimization": {"sub_group_size": "AUTO",
                          "offload_optimizer": {"device": "nvme", "nvme_path": "/n",
                                                "buffer_count": 2}},
    "bf16": {"enabled": true}, "strata": {"host_budget": "16GiB"}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sub_group_elems, kSubGroupAuto);
  ASSERT_TRUE(ValidateConfig(*c).ok());
  // Adam state 12 + bf16 param 2 + bf16 grad 2 (one rank) per element and buffer.
  EXPECT_EQ(SubGroupElemsFor(*c, 6'000'000'000),
            AutoSubGroupElems({.shard_elems = 6'000'000'000, .staging_bytes_per_elem = 16,
                               .buffer_count = 2, .host_budget_bytes = 16 * kGiB, .nvme = true}));
  // With several ranks the gradient is not a per-buffer slot (it is the shard buffer).
  EXPECT_EQ(SubGroupElemsFor(*c, 6'000'000'000, 4),
            AutoSubGroupElems({.shard_elems = 6'000'000'000, .staging_bytes_per_elem = 14,
                               .buffer_count = 2, .host_budget_bytes = 16 * kGiB, .nvme = true}));
  // No NVMe: the budget caps nothing.
  c->device = OffloadDevice::kCpu;
  EXPECT_EQ(SubGroupElemsFor(*c, 6'000'000'000),
            AutoSubGroupElems({.shard_elems = 6'000'000'000}));
}

TEST(ConfigTest, PlacementInputsFollowTheConfig) {
  Result<OffloadConfig> c = ParseConfigJson(R"({
    "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/n",
                                                "buffer_count": 3}},
    "aio": {"block_size": 8192}, "optimizer": {"type": "Lion"}, "bf16": {"enabled": true},
    "strata": {"host_budget": "1GiB", "device_budget": "2GiB", "grad_dtype": "fp32"}})");
  ASSERT_TRUE(c.ok()) << c.status();
  const uint64_t groups[] = {10, 5, 10, 2};
  const PlacementInputs in = PlacementInputsFor(*c, groups);
  EXPECT_EQ(in.sub_group_elems, (std::vector<uint64_t>{10, 5, 10, 2}));
  EXPECT_EQ(in.state_bytes_per_elem, 8u);
  EXPECT_EQ(in.grad_bytes_per_elem, 4u);
  EXPECT_EQ(in.param_bytes_per_elem, 2u);
  EXPECT_EQ(in.host_budget_bytes, kGiB);
  EXPECT_EQ(in.device_budget_bytes, 2 * kGiB);
  EXPECT_EQ(in.nvme, NvmeTier::kAvailable);
  EXPECT_EQ(in.buffer_count, 3u);
  EXPECT_EQ(in.block_bytes, 8192u);
  // Never more buffers than sub-groups.
  const uint64_t two[] = {10, 5};
  EXPECT_EQ(PlacementInputsFor(*c, two).buffer_count, 2u);
  OffloadConfig cpu = *c;
  cpu.device = OffloadDevice::kCpu;
  EXPECT_EQ(PlacementInputsFor(cpu, groups).nvme, NvmeTier::kUnavailable);
}

}  // namespace
}  // namespace strata
