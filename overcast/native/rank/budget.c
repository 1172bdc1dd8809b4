#include "budget.h"

void oc_budget_init(oc_budget *b, double rate, double burst_seconds, uint32_t batch,
                    uint32_t datagram_bytes, uint32_t reduction_batch) {
    b->rate = rate > 0 ? rate : 0;
    b->batch = batch ? batch : 1;
    b->reduction_batch = reduction_batch > b->batch ? reduction_batch : b->batch;
    double floor = b->rate ? 2.0 * b->reduction_batch * datagram_bytes : 0;
    b->burst = b->rate * burst_seconds > floor ? b->rate * burst_seconds : floor;
    b->tokens = b->burst;
    b->updated = 0;
    b->fresh = 1;
    b->reductions_in_flight = 0;
    b->gathers_in_flight = 0;
}

static void refill(oc_budget *b, double now) {
    if (!b->fresh && now > b->updated) {
        b->tokens += (now - b->updated) * b->rate;
        if (b->tokens > b->burst) b->tokens = b->burst;
    }
    if (b->fresh || now > b->updated) b->updated = now;
    b->fresh = 0;
}

void oc_budget_take(oc_budget *b, double nbytes, double now) {
    if (!b->rate) return;
    refill(b, now);
    b->tokens -= nbytes;
}

static double wanted(const oc_budget *b, double nbytes) {
    return nbytes < b->burst ? nbytes : b->burst;
}

int oc_budget_try_take(oc_budget *b, double nbytes, double now) {
    if (!b->rate) return 1;
    refill(b, now);
    if (b->tokens < wanted(b, nbytes) - 0.5) return 0; /* half a byte: float rounding */
    b->tokens -= nbytes;
    return 1;
}

double oc_budget_ready_at(oc_budget *b, double nbytes, double now) {
    if (!b->rate) return now;
    refill(b, now);
    double short_by = wanted(b, nbytes) - b->tokens;
    return now + (short_by > 0 ? short_by / b->rate : 0);
}
