// Armv8.2 dotprod (sdot by element) tile for the kArm4 layout.
// Compiled with -march=armv8.2-a+dotprod.
#include <arm_neon.h>

#include "w4a8.h"

#define LRJAX_ARM_DOTPROD
#define LRJAX_TILE_NAME TileArm4Dotprod
#include "w4a8_arm4.inc"
