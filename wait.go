package egressproxy

import (
	"context"
	"fmt"
	"time"

	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/internal/naming"
)

// WaitOptions tune Client.WaitRunning. A nil *WaitOptions is valid.
type WaitOptions struct {
	// Interval is the pause between two reads of the instance. Zero: 1s.
	Interval time.Duration
}

const defaultWaitInterval = time.Second

// WaitRunning reads the instance back until it is Running with an address,
// and returns it: the one way to wait for a created instance to come up.
// The budget is ctx: when it ends, the error is DeadlineExceeded (or
// Canceled) and says the last state or error seen. A Transient error of a
// read is waited through; any other ends the wait with its class (NotFound:
// the instance is gone; Permanent). An instance that is Failed or Stopped
// does not come up by itself: that is a Permanent error naming the state
// (Create starts a Stopped instance again). The wait is one operation of
// the client ("wait"): one span and one log line, whatever the number of
// reads.
func (c *Client) WaitRunning(ctx context.Context, ref Ref, opts *WaitOptions) (Instance, error) {
	interval := defaultWaitInterval
	if opts != nil && opts.Interval > 0 {
		interval = opts.Interval
	}
	var inst Instance
	err := c.run(ctx, "wait", ref.Name, func(ctx context.Context) error {
		if err := naming.ValidateRef(ref.Name, ref.UID); err != nil {
			return err
		}
		var err error
		inst, err = c.waitRunning(ctx, ref, interval)
		return err
	})
	return inst, err
}

func (c *Client) waitRunning(ctx context.Context, ref Ref, interval time.Duration) (Instance, error) {
	t := time.NewTimer(0)
	defer t.Stop()
	last := "not read yet"
	for {
		select {
		case <-ctx.Done():
			return Instance{}, errs.FromContext(fmt.Errorf("not running (%s): %w", last, ctx.Err()))
		case <-t.C:
		}
		inst, err := c.p.Get(ctx, ref)
		switch {
		case err == nil && inst.State == StateRunning && inst.IP != "":
			return inst, nil
		case err == nil && (inst.State == StateFailed || inst.State == StateStopped):
			return Instance{}, errs.Errorf(errs.Permanent, "instance is %s", inst.State)
		case err == nil:
			last = "state " + string(inst.State)
		case errs.Code(err) == errs.Transient:
			last = err.Error()
		case ctx.Err() != nil:
			continue // reported by the next select
		default:
			return Instance{}, err
		}
		t.Reset(interval)
	}
}
