package budget

import (
	"context"
	"errors"
	"testing"
	"time"
)

func TestErr(t *testing.T) {
	t.Parallel()
	if err := Err(context.Background()); err != nil {
		t.Fatalf("live context: %v", err)
	}
	ctx, cancel := WithTimeout(context.Background(), "DialTimeout", time.Millisecond)
	defer cancel()
	<-ctx.Done()
	var te *TimeoutError
	if err := Err(ctx); !errors.As(err, &te) || te.Budget != "DialTimeout" || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("budget ran out: %v", err)
	}
	if got, want := te.Error(), "no answer within DialTimeout (1ms)"; got != want || !te.Timeout() {
		t.Errorf("text %q (timeout %v), want %q", got, te.Timeout(), want)
	}
	// The caller cancels before the budget: Canceled.
	parent, cancelParent := context.WithCancel(context.Background())
	ctx2, cancel2 := WithTimeout(parent, "CallTimeout", time.Hour)
	defer cancel2()
	cancelParent()
	if err := Err(ctx2); !errors.Is(err, context.Canceled) {
		t.Fatalf("caller canceled: %v", err)
	}
	// The caller's earlier deadline: DeadlineExceeded.
	parent3, cancel3 := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel3()
	ctx3, cancel4 := WithTimeout(parent3, "CallTimeout", time.Hour)
	defer cancel4()
	<-ctx3.Done()
	if err := Err(ctx3); !errors.Is(err, context.DeadlineExceeded) || errors.As(err, new(*TimeoutError)) {
		t.Fatalf("caller's deadline: %v", err)
	}
}
