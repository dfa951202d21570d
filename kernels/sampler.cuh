// sampler.cuh: the request's sampling settings and the counter-based Gumbel noise, as the
// lm_head (which adds noise to every logit when no filter applies) and the device sampler
// (sampler.cu, which draws among the kept tokens) both compute them.
//
// Reference: nanoqwen/sampling.py (gumbel_noise, sample): the host computes the same keys.
#pragma once

#include "common.cuh"

// How the next token is chosen: set by the host per request (CudaBackend.set_sampler). A null
// pointer, or temperature 0, means greedy.
struct SamplerSettings {
  unsigned int key0, key1;  // from the seed: SamplingParams.key
  double temperature;
  int top_k;                // 0: every token (the lm_head adds the noise); else at most TOP_K_MAX
  int nucleus_of_all;       // 1: top_p weighs every token, and the device keeps the top_k most likely
  double top_p;             // 1: no nucleus; else applied to the top_k kept tokens (or to all, above)
};

// nanoqwen.sampling._mix32: a bijective avalanche of a 32-bit word.
__device__ __forceinline__ unsigned int mix32(unsigned int x) {
  x ^= x >> 16;
  x *= 0x21f0aaadu;
  x ^= x >> 15;
  x *= 0x735a2d97u;
  return x ^ (x >> 15);
}

// The step's part of nanoqwen.sampling.gumbel_noise's hash: the key words and the position.
__device__ __forceinline__ unsigned int noise_step(const SamplerSettings& settings, int position) {
  return mix32(settings.key1 ^ mix32(settings.key0 ^ mix32(position)));
}

// nanoqwen.sampling.gumbel_noise for one token id, `step` from noise_step: 52 bits,
// u = (bits + 1/2) / 2^52 strictly inside (0, 1), g = -log(-log(u)), all in float64.
__device__ __forceinline__ double gumbel_noise(unsigned int step, int id) {
  const unsigned long long high = mix32(mix32(2u * id) ^ step), low = mix32(mix32(2u * id + 1u) ^ step);
  const double u = ((double)((high << 20) | (low >> 12)) + 0.5) * (1.0 / 4503599627370496.0);  // 2^52
  return -log(-log(u));
}
