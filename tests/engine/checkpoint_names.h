// The names every checkpoint suite (checkpoint_*_test.cc) uses, declared once: the engine's and
// the models' namespaces, JSON, and the shared trainer, launcher and file helpers.
#pragma once

#include <nlohmann/json.hpp>

#include "checkpoint_fixture.h"
#include "checkpoint_trainer.h"
#include "launched.h"
#include "test_util.h"

namespace se = strata::engine;
namespace sm = strata::models;
using nlohmann::json;
using strata::test::TempDir;
using strata::test::Losses;
using strata::test::Trainer;
using strata::test::expect_bitwise;
using strata::test::tiny_llama;
using strata::test::launch;
using strata::test::launch_on_nodes;
using strata::test::losses;
using strata::test::read_file;
using strata::test::run_quiet;
using strata::test::st_tensor;
