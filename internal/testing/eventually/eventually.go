package eventually

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// The poll interval starts at firstTick and doubles up to maxTick.
const (
	firstTick = time.Millisecond
	maxTick   = 50 * time.Millisecond
)

// True polls cond until it returns true, or fails tb (Fatalf) once d has
// passed, saying what it waited for (format, args) and for how long.
func True(tb testing.TB, d time.Duration, cond func() bool, format string, args ...any) {
	tb.Helper()
	if !Poll(context.Background(), d, cond) {
		tb.Fatalf("not within %v: %s", d, fmt.Sprintf(format, args...))
	}
}

// NoError polls fn until it returns nil, or fails tb (Fatalf) once d has
// passed with what it waited for and fn's last error.
func NoError(tb testing.TB, d time.Duration, fn func() error, format string, args ...any) {
	tb.Helper()
	var last error
	if !Poll(context.Background(), d, func() bool { last = fn(); return last == nil }) {
		tb.Fatalf("not within %v: %s: last error: %v", d, fmt.Sprintf(format, args...), last)
	}
}

// Poll polls cond until it returns true (true), or until d has passed or
// ctx ends (false). cond runs in the caller's goroutine; it is called at
// least once, and once more at the deadline.
func Poll(ctx context.Context, d time.Duration, cond func() bool) bool {
	return poll(ctx, d, firstTick, maxTick, cond)
}

// PollEvery is Poll at a fixed interval, for a condition that costs (a
// call to a real host over a slow link).
func PollEvery(ctx context.Context, d, every time.Duration, cond func() bool) bool {
	return poll(ctx, d, every, every, cond)
}

func poll(ctx context.Context, d, first, most time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	tick := first
	t := time.NewTimer(tick)
	defer t.Stop()
	for {
		if cond() {
			return true
		}
		left := time.Until(deadline)
		if left <= 0 {
			return false
		}
		t.Reset(min(tick, left))
		select {
		case <-ctx.Done():
			return false
		case <-t.C:
		}
		tick = min(2*tick, most)
	}
}
