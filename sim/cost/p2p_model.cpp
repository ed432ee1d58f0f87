#include "sim/cost/p2p_model.h"

// LinkP2PModel::duration is inline in the header: the engine calls it once per send.
