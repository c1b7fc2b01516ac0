package kvm2

import (
	"context"
	"sync"
)

// limiter bounds the calls one operation has in flight: acquire takes a
// slot (or returns ctx's error), release gives it back. A nil limiter
// bounds nothing.
type limiter chan struct{}

func (l limiter) acquire(ctx context.Context) error {
	if l == nil {
		return nil
	}
	select {
	case l <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (l limiter) release() {
	if l != nil {
		<-l
	}
}

// forEach runs fn for each i in [0, n), at most limit at once, and waits
// for all of them: no goroutine it starts outlives it. The first error
// (in time) cancels the context the other calls got and stops handing out
// indices; it is returned, and the errors after it (caused by that
// cancellation) are dropped, so the result keeps the class of the failure
// that decided it. When ctx ends before every index was handed out and no
// call failed, forEach returns ctx's error.
func forEach(ctx context.Context, n, limit int, fn func(ctx context.Context, i int) error) error {
	if n == 0 {
		return ctx.Err()
	}
	gctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		next  int
		first error
	)
	take := func() (int, bool) {
		mu.Lock()
		defer mu.Unlock()
		if first != nil || gctx.Err() != nil || next == n {
			return 0, false
		}
		next++
		return next - 1, true
	}
	for range min(limit, n) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i, ok := take()
				if !ok {
					return
				}
				if err := fn(gctx, i); err != nil {
					mu.Lock()
					if first == nil {
						first = err
						cancel()
					}
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	if first != nil {
		return first
	}
	if next < n {
		return ctx.Err()
	}
	return nil
}
