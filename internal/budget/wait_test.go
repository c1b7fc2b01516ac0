package budget

import (
	"sync"
	"testing"
	"time"
)

func TestWait(t *testing.T) {
	var wg sync.WaitGroup
	if !Wait(&wg, time.Second) {
		t.Fatal("Wait of a finished group reported a timeout")
	}
	wg.Add(1)
	if Wait(&wg, 10*time.Millisecond) {
		t.Fatal("Wait of a running group reported it finished")
	}
	wg.Done() // lets the first Wait's goroutine end
}
