package eventually

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"
)

func TestPoll(t *testing.T) {
	var n atomic.Int32
	if !Poll(context.Background(), time.Second, func() bool { return n.Add(1) == 5 }) {
		t.Fatal("Poll gave up before the condition held")
	}
	start := time.Now()
	if Poll(context.Background(), 20*time.Millisecond, func() bool { return false }) {
		t.Fatal("Poll of a false condition reported true")
	}
	if e := time.Since(start); e < 20*time.Millisecond {
		t.Fatalf("Poll gave up after %v, before its deadline", e)
	}
	n.Store(0)
	if !PollEvery(context.Background(), time.Second, time.Millisecond, func() bool { return n.Add(1) == 3 }) {
		t.Fatal("PollEvery gave up before the condition held")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if Poll(ctx, time.Hour, func() bool { return false }) {
		t.Fatal("Poll with an ended context reported true")
	}
}

// fakeTB records a Fatalf instead of ending the test.
type fakeTB struct {
	testing.TB
	msg string
}

func (f *fakeTB) Helper() {}
func (f *fakeTB) Fatalf(format string, args ...any) {
	f.msg = format
	_ = args
}

func TestTrueAndNoErrorFail(t *testing.T) {
	f := &fakeTB{TB: t}
	True(f, 5*time.Millisecond, func() bool { return false }, "never")
	if f.msg == "" {
		t.Fatal("True did not fail on a condition that never held")
	}
	f.msg = ""
	NoError(f, 5*time.Millisecond, func() error { return errors.New("boom") }, "never")
	if f.msg == "" {
		t.Fatal("NoError did not fail on an error that never went away")
	}
	f.msg = ""
	True(f, time.Second, func() bool { return true }, "at once")
	NoError(f, time.Second, func() error { return nil }, "at once")
	if f.msg != "" {
		t.Fatal("a condition that held failed")
	}
}
