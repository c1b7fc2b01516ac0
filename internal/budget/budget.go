package budget

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// TimeoutError says that one of the module's own budgets ran out while the
// caller's context was still live.
type TimeoutError struct {
	Budget string        // the configuration field: "DialTimeout", "CallTimeout"
	After  time.Duration // its value
}

func (e *TimeoutError) Error() string {
	return fmt.Sprintf("no answer within %s (%v)", e.Budget, e.After)
}

// Timeout reports true, like the net package's timeout errors.
func (e *TimeoutError) Timeout() bool { return true }

// WithTimeout returns ctx bounded by d; when d (and not ctx's own deadline
// or cancellation) ends it, context.Cause of the returned context is a
// *TimeoutError naming budget, which Err then returns.
func WithTimeout(ctx context.Context, budget string, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeoutCause(ctx, d, &TimeoutError{Budget: budget, After: d})
}

// Err returns why ctx ended: the *TimeoutError of a budget set by
// WithTimeout when that is what ended it, otherwise ctx.Err() (so
// context.Canceled or context.DeadlineExceeded of the caller's own
// context). It returns nil while ctx is live.
func Err(ctx context.Context) error {
	err := ctx.Err()
	if err == nil {
		return nil
	}
	var te *TimeoutError
	if cause := context.Cause(ctx); errors.As(cause, &te) {
		return cause
	}
	return err
}
