package budget

import (
	"sync"
	"time"
)

// Wait waits for wg at most d and reports whether wg finished: how Close
// waits for the goroutines it owns without blocking on one that hangs.
func Wait(wg *sync.WaitGroup, d time.Duration) bool {
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-done:
		return true
	case <-t.C:
		return false
	}
}
