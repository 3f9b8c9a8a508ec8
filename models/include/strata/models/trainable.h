// model.trainable: which of a model's tensors train. The others are frozen: they have no
// gradient, no reduce-scatter, no master weights and no moments, only their compute copy.
//
// Grammar (docs/CONFIG.md "model.trainable"): a pattern is matched against a tensor's whole
// Hugging Face name ("model.layers.3.mlp.up_proj.weight", "transformer.h.0.attn.c_attn.bias",
// "lm_head.weight"); a block tile's part is judged by its whole tensor's name.
//   *        any run of characters, dots included, possibly empty
//   {A-B}    a decimal number n with A <= n <= B (a layer range: "model.layers.{0-11}.*")
//   other    itself
// A tensor trains when any pattern matches all of its name. No patterns: every tensor trains.
//
// Pure value type; thread-safe. Errors: std::invalid_argument for a malformed pattern (an
// unclosed or empty range, A > B), naming it.
#pragma once

#include <string>
#include <vector>

namespace strata::models {

class TrainableTensors {
 public:
  TrainableTensors() = default;  // every tensor trains
  explicit TrainableTensors(std::vector<std::string> patterns);

  bool all() const { return patterns_.empty(); }
  const std::vector<std::string>& patterns() const { return patterns_; }
  bool trainable(const std::string& whole_name) const;
  // Throws std::invalid_argument naming every pattern that matches none of `names` (a model's
  // tensors), and when no tensor of `names` trains.
  void check_against(const std::vector<std::string>& names) const;

  // Whether `pattern` matches all of `name` (the grammar above). Throws for a malformed pattern.
  static bool matches(const std::string& pattern, const std::string& name);

 private:
  std::vector<std::string> patterns_;
};

}  // namespace strata::models
