// Baseline NEON tile for the kArm4 layout: smull + sadalp widening dot products.
#include <arm_neon.h>

#include "w4a8.h"

#define LRJAX_TILE_NAME TileArm4Neon
#include "w4a8_arm4.inc"
