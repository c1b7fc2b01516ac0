package benchutil

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestEach(t *testing.T) {
	var (
		mu      sync.Mutex
		seen    = map[int]int{}
		running atomic.Int32
		most    atomic.Int32
	)
	err := Each(context.Background(), 50, 4, func(i int) error {
		n := running.Add(1)
		for {
			m := most.Load()
			if n <= m || most.CompareAndSwap(m, n) {
				break
			}
		}
		time.Sleep(time.Millisecond)
		running.Add(-1)
		mu.Lock()
		seen[i]++
		mu.Unlock()
		return nil
	})
	if err != nil || len(seen) != 50 {
		t.Fatalf("Each = %v, %d distinct i, want nil and 50", err, len(seen))
	}
	for i, c := range seen {
		if c != 1 || i < 0 || i >= 50 {
			t.Errorf("i %d ran %d times", i, c)
		}
	}
	if m := most.Load(); m > 4 {
		t.Errorf("%d at once, want at most 4", m)
	}

	boom := errors.New("boom")
	var calls atomic.Int32
	err = Each(context.Background(), 1000, 2, func(i int) error {
		calls.Add(1)
		if i == 3 {
			return boom
		}
		return nil
	})
	if !errors.Is(err, boom) || calls.Load() > 10 {
		t.Errorf("after an error: %v, %d calls; want boom, and no more work handed out", err, calls.Load())
	}

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := Each(ctx, 10, 2, func(int) error { t.Error("ran after ctx ended"); return nil }); !errors.Is(err, context.Canceled) {
		t.Errorf("ended ctx: %v", err)
	}
}
