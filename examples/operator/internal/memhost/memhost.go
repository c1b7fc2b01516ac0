// Package memhost serves memory entries (memprovider clients) from one
// process to others over HTTP and JSON on a loopback listener: a simulated
// hypervisor whose VMs outlive the operator that created them, as a kvm2
// entry's VMs outlive their operator on the hypervisor. The scale bench
// (cmd/scale) runs the memory host and gives both operator replicas the
// same entries through it, so that a new leader finds the VMs the old one
// created.
//
// The protocol is the driver.Provider's five calls, one POST each at
// /v1/ENTRY/OPERATION (create, get, delete, list, check) with the
// argument as the JSON body; a result is 200 with its JSON, an error any
// other status with an errorBody: the error's class and message, which
// the provider (NewClient) classes again with driver.Errorf, so that
// egressproxy.Code of an error is the same on both sides.
package memhost

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/loopback"
	"github.com/egressproxy/egressproxy/memprovider"
)

// The operations, the last element of a request's path.
const (
	opCreate = "create"
	opGet    = "get"
	opDelete = "delete"
	opList   = "list"
	opCheck  = "check"
)

// maxBody bounds a request's or an answer's body: a List of thousands of
// instances fits.
const maxBody = 64 << 20

// errorBody is an error as it crosses the link: its class, its message
// and, for the sentinels a caller tests with errors.Is, which one.
type errorBody struct {
	Code    egressproxy.ErrorCode `json:"code"`
	Message string                `json:"message"`
	// Is is "specConflict" or "closed" when the error is
	// egressproxy.ErrSpecConflict or egressproxy.ErrClosed, else "".
	Is string `json:"is,omitempty"`
}

// Server serves memory entries. Close ends it.
type Server struct {
	ln      net.Listener
	srv     *http.Server
	entries map[string]*egressproxy.Client
	served  chan struct{}
	serr    error
	once    sync.Once

	mu      sync.Mutex
	closing bool
	calls   sync.WaitGroup // handlers running; none starts once closing
}

// Serve starts a memory host on addr (a loopback host:port; port 0 picks
// one) serving one memprovider client per entry, each made with its
// Options (memprovider.New): CallDelay, ProvisionDelay, ServeProxies and
// Entry are the simulated hypervisor's. Every Entry must be set and
// distinct.
func Serve(addr string, entries []memprovider.Options) (*Server, error) {
	if !loopback.HostPort(addr) {
		return nil, &egressproxy.FieldError{Field: "addr", Value: addr, Rule: "must be a loopback host:port"}
	}
	clients := map[string]*egressproxy.Client{}
	for i, o := range entries {
		switch _, dup := clients[o.Entry]; {
		case o.Entry == "":
			return nil, &egressproxy.FieldError{Field: fmt.Sprintf("entries[%d].Entry", i), Rule: "is required"}
		case dup:
			return nil, &egressproxy.FieldError{Field: fmt.Sprintf("entries[%d].Entry", i), Value: o.Entry, Rule: "is the name of an earlier entry"}
		}
		clients[o.Entry] = nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	for _, o := range entries {
		clients[o.Entry] = memprovider.New(&o)
	}
	s := &Server{ln: ln, entries: clients, served: make(chan struct{})}
	s.srv = &http.Server{Handler: s, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		defer close(s.served)
		if err := s.srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			s.serr = err
		}
	}()
	return s, nil
}

// URL is the host's endpoint, http://127.0.0.1:PORT.
func (s *Server) URL() string { return "http://" + s.ln.Addr().String() }

// Close stops serving, waits for the calls in progress and closes every
// entry's client (which stops its VMs' proxies). It is idempotent.
func (s *Server) Close() error {
	var err error
	s.once.Do(func() {
		s.mu.Lock()
		s.closing = true
		s.mu.Unlock()
		err = s.srv.Close()
		<-s.served
		s.calls.Wait()
		for _, c := range s.entries {
			err = errors.Join(err, c.Close())
		}
		err = errors.Join(err, s.serr)
	})
	return err
}

// ServeHTTP answers POST /v1/ENTRY/OPERATION.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		writeError(w, http.StatusServiceUnavailable, egressproxy.Transient, errors.New("memory host: closing"))
		return
	}
	s.calls.Add(1)
	s.mu.Unlock()
	defer s.calls.Done()
	rest, ok := strings.CutPrefix(r.URL.Path, "/v1/")
	entry, op, ok2 := strings.Cut(rest, "/")
	c := s.entries[entry]
	switch {
	case !ok || !ok2 || c == nil:
		writeError(w, http.StatusNotFound, egressproxy.Permanent, fmt.Errorf("memory host: no entry %q", entry))
		return
	case r.Method != http.MethodPost:
		writeError(w, http.StatusMethodNotAllowed, egressproxy.Permanent, errors.New("memory host: POST only"))
		return
	}
	// The whole body is read first: the server watches the connection,
	// and cancels ctx when the caller goes away, only after that.
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	if err != nil {
		writeError(w, http.StatusBadRequest, egressproxy.Permanent, fmt.Errorf("memory host: reading the request: %w", err))
		return
	}
	ctx := r.Context()
	var res any
	switch op {
	case opCreate:
		var spec egressproxy.Spec
		if err = decode(body, &spec); err == nil {
			res, err = c.Create(ctx, spec)
		}
	case opGet, opDelete:
		var ref egressproxy.Ref
		if err = decode(body, &ref); err == nil {
			if op == opGet {
				res, err = c.Get(ctx, ref)
			} else {
				res, err = struct{}{}, c.Delete(ctx, ref)
			}
		}
	case opList:
		res, err = c.List(ctx)
	case opCheck:
		res, err = c.Check(ctx)
	default:
		writeError(w, http.StatusNotFound, egressproxy.Permanent, fmt.Errorf("memory host: no operation %q", op))
		return
	}
	if err != nil {
		writeError(w, http.StatusUnprocessableEntity, egressproxy.Code(err), err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(res)
}

func decode(body []byte, v any) error {
	if err := json.Unmarshal(body, v); err != nil {
		return &egressproxy.FieldError{Field: "body", Rule: "must be the operation's argument as JSON: " + err.Error()}
	}
	return nil
}

func writeError(w http.ResponseWriter, status int, code egressproxy.ErrorCode, err error) {
	b := errorBody{Code: code, Message: err.Error()}
	switch {
	case errors.Is(err, egressproxy.ErrSpecConflict):
		b.Is = "specConflict"
	case errors.Is(err, egressproxy.ErrClosed):
		b.Is = "closed"
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(b)
}

// CheckEndpoint is the rule endpoint breaks as a memory host's URL, ""
// when none: an http URL of a loopback host with a port and nothing else
// (no path, query or user).
func CheckEndpoint(endpoint string) string {
	const rule = "must be http://HOST:PORT of a memory host with a loopback HOST (127.0.0.1, [::1] or localhost)"
	rest, ok := strings.CutPrefix(endpoint, "http://")
	if !ok || strings.ContainsAny(rest, "/?#@") || !loopback.HostPort(rest) {
		return rule
	}
	_, port, _ := net.SplitHostPort(rest)
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return rule
	}
	return ""
}
