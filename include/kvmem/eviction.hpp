#pragma once
/// \file eviction.hpp
/// Everything of fixed-budget eviction: the memory, every eviction scorer, SnapKV's one-shot selection and
/// the training masks (kvpop-paper; spec EVICTION.md).

#include "eviction_config.hpp"
#include "eviction_memory.hpp"
#include "kernels/eviction/snapkv.hpp"
#include "policy/score/accumulated_attention.hpp"
#include "policy/score/key_norm.hpp"
#include "policy/score/last_query_attention.hpp"
#include "policy/score/mlstm.hpp"
#include "policy/score/none.hpp"
#include "policy/score/observation_window.hpp"
#include "training/eviction_mask.hpp"
