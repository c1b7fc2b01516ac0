package imagecache

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/egressproxy/egressproxy/provider"
)

// roundTripFunc is an http.RoundTripper made of a function.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// deadlineRecorder is a transport that records the deadline of each
// request's context and fails the request (so fetch stops before libvirt).
type deadlineRecorder struct {
	mu        sync.Mutex
	deadlines []time.Time
}

var errRecorded = errors.New("recorded; no request sent")

func (d *deadlineRecorder) RoundTrip(r *http.Request) (*http.Response, error) {
	dl, ok := r.Context().Deadline()
	if !ok {
		dl = time.Time{}
	}
	d.mu.Lock()
	d.deadlines = append(d.deadlines, dl)
	d.mu.Unlock()
	return nil, errRecorded
}

// The HTTP deadline is the flight's own deadline (the TransferBudget
// counted from the start of the flight) minus HTTPGrace: time the flight
// spent before the GET (waiting for another writer's claim, removing
// debris) comes off the HTTP download, never off the grace. The flight is
// modelled by its context; no clock is read for the assertion.
func TestHTTPDeadlineIsFlightDeadlineMinusGrace(t *testing.T) {
	const budget, grace = 20 * time.Minute, time.Minute
	rec := &deadlineRecorder{}
	c, err := New(&fakeConn{}, Config{Entry: "e", Pool: "p", TransferBudget: budget, HTTPGrace: grace, HTTPClient: &http.Client{Transport: rec}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	for _, tt := range []struct {
		name string
		// left is what remains of the flight's budget when the GET starts.
		left time.Duration
	}{
		{"fresh flight", budget},
		{"after a 15 minute claim wait", budget - 15*time.Minute},
		{"grace and a little", grace + time.Second},
	} {
		t.Run(tt.name, func(t *testing.T) {
			flightDeadline := time.Now().Add(tt.left)
			ctx, cancel := context.WithDeadline(context.Background(), flightDeadline)
			defer cancel()
			rec.mu.Lock()
			rec.deadlines = nil
			rec.mu.Unlock()
			_, err := c.fetchOnce(ctx, okImage, c.BaseName(okImage))
			if !errors.Is(err, errRecorded) {
				t.Fatalf("fetchOnce = %v, want the transport's error", err)
			}
			rec.mu.Lock()
			defer rec.mu.Unlock()
			if len(rec.deadlines) != 1 {
				t.Fatalf("%d requests", len(rec.deadlines))
			}
			if got, want := rec.deadlines[0], flightDeadline.Add(-grace); !got.Equal(want) {
				t.Fatalf("HTTP deadline is %s before the flight's, want %s (HTTPGrace)", flightDeadline.Sub(got), grace)
			}
		})
	}
	t.Run("less than the grace left", func(t *testing.T) {
		ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(grace/2))
		defer cancel()
		rec.mu.Lock()
		rec.deadlines = nil
		rec.mu.Unlock()
		_, err := c.fetchOnce(ctx, okImage, c.BaseName(okImage))
		if provider.Code(err) != provider.Transient || !strings.Contains(err.Error(), "HTTPGrace") {
			t.Fatalf("fetchOnce = %v, want Transient naming HTTPGrace", err)
		}
		rec.mu.Lock()
		defer rec.mu.Unlock()
		if len(rec.deadlines) != 0 {
			t.Fatalf("a GET was sent with deadlines %v although the budget cannot hold it", rec.deadlines)
		}
	})
}
