package soak

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"sync"
	"time"
)

// Event kinds in the log.
const (
	EvStep      = "step"      // a scheduled step was applied (Op = its kind)
	EvFaultEnd  = "fault-end" // a fault was healed (Op = its kind)
	EvCall      = "call"      // a library call returned (Op = the call)
	EvCheck     = "check"     // an invariant was checked (Op = its name)
	EvViolation = "violation" // an invariant broke (Op = its name)
	EvNote      = "note"      // anything else worth the log (seed, phases)

	// Sent by a driver process to the supervising test (and, but for
	// EvLog, kept in the log): EvCallStart opens the call EvCall closes
	// (same ID), so a call that never returns is seen while it hangs.
	EvCallStart = "call-start"
	EvLog       = "log"       // a log line of the driver's logger (Detail), checked for secrets, not kept
	EvSample    = "sample"    // a settled sample of the driver (Gor, RSS), asked for by the supervisor
	EvFinalized = "finalized" // a deleted proxy's instance is gone (Instance, Detail = its UID): its tombstone may go
	EvReady     = "ready"     // a driver process read its config and runs (Gor: its goroutines before any entry was opened)
	EvExit      = "exit"      // a driver process stopped cleanly (Gor: goroutines left after every client closed)
	EvSpawn     = "spawn"     // the supervisor started a driver process (PID, Detail its role)
	EvKilled    = "killed"    // the supervisor SIGKILLed one (PID; Detail: calls in flight)
)

// Event is one line of the event log.
type Event struct {
	T        time.Time     `json:"t"`
	Kind     string        `json:"kind"`
	Host     int           `json:"host,omitempty"`
	Op       string        `json:"op,omitempty"`
	Instance string        `json:"instance,omitempty"`
	Result   string        `json:"result,omitempty"` // "OK" or the error class (provider.Code)
	Err      string        `json:"err,omitempty"`
	Latency  time.Duration `json:"latency,omitempty"`
	Detail   string        `json:"detail,omitempty"`
	// PID is the driver process an event came from (0: the supervisor);
	// ID pairs an EvCallStart with its EvCall.
	PID int    `json:"pid,omitempty"`
	ID  uint64 `json:"id,omitempty"`
	// Budget is the deadline a driver gave the call (EvCallStart, EvCall).
	Budget time.Duration `json:"budget,omitempty"`
	// Gor and RSS are a driver's goroutines and resident bytes (EvSample,
	// EvReady, EvExit).
	Gor int   `json:"gor,omitempty"`
	RSS int64 `json:"rss,omitempty"`
}

// Log is the event log: every event is kept in memory (for the report and
// the checkers) and written as a JSON line to W, when set. It is safe for
// concurrent use.
type Log struct {
	mu     sync.Mutex
	w      *bufio.Writer
	events []Event
	now    func() time.Time
}

// NewLog returns a log writing to w (nil: memory only); now, when not nil,
// stamps events (for tests), time.Now otherwise.
func NewLog(w io.Writer, now func() time.Time) *Log {
	l := &Log{now: now}
	if l.now == nil {
		l.now = time.Now
	}
	if w != nil {
		l.w = bufio.NewWriter(w)
	}
	return l
}

// Add stamps e (when its T is zero), keeps it and writes it.
func (l *Log) Add(e Event) Event {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e.T.IsZero() {
		e.T = l.now()
	}
	l.events = append(l.events, e)
	if l.w != nil {
		b, _ := json.Marshal(e)
		_, _ = l.w.Write(append(b, '\n'))
	}
	return e
}

// Flush writes what is buffered.
func (l *Log) Flush() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.w == nil {
		return nil
	}
	return l.w.Flush()
}

// Events returns a copy of every event so far.
func (l *Log) Events() []Event {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]Event(nil), l.events...)
}

// Last returns the last n events (fewer when there are fewer).
func (l *Log) Last(n int) []Event {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]Event(nil), l.events[max(0, len(l.events)-n):]...)
}

// ReadEvents reads an event log written by Log.
func ReadEvents(r io.Reader) ([]Event, error) {
	var out []Event
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for n := 1; sc.Scan(); n++ {
		var e Event
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			return out, fmt.Errorf("soak: event log line %d: %w", n, err)
		}
		out = append(out, e)
	}
	return out, sc.Err()
}

// StepEvents is the part of an event log that a seed determines: the
// scheduled steps applied, in order, as their kind, host and Detail (the
// step's text, without time). Two runs with one seed have equal
// StepEvents, whatever the library did.
func StepEvents(events []Event) []string {
	var out []string
	for _, e := range events {
		if e.Kind == EvStep {
			out = append(out, e.Detail)
		}
	}
	return out
}

// StepDetail is the Detail of the step event of s: s without its time.
func StepDetail(s Step) string {
	s.At = 0
	b, _ := json.Marshal(s)
	return string(b)
}
