package health

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/egressproxy/egressproxy/internal/errs"
)

// defaultTimeout bounds a probe whose ProbeOptions.Timeout is zero.
const defaultTimeout = 10 * time.Second

// ProbeOptions configures Probe. A nil *ProbeOptions is valid and means the
// zero value of every field.
type ProbeOptions struct {
	// Timeout bounds the whole probe: dial, CONNECT exchange and tunnel
	// proof. Zero means 10s; a negative value means no timeout of the
	// probe's own (only the context's deadline applies).
	Timeout time.Duration

	// Username and Password, when Username is not empty, are sent as
	// "Proxy-Authorization: Basic ..." with the CONNECT request. Username
	// must not contain ':' (RFC 7617). Zero: no credentials are sent.
	// Password never reaches a log line, an error or String.
	Username string
	Password string

	// TLS, when not nil, proves the tunnel with a TLS handshake through it
	// after the proxy answered 2xx. When TLS.ServerName is empty it is set
	// to the target's host (on a clone; TLS is never modified). Zero: no
	// TLS handshake.
	TLS *tls.Config

	// Exchange, when not nil, proves the tunnel with a caller-supplied
	// exchange through it after the proxy answered 2xx (and after the TLS
	// handshake when TLS is set, in which case conn is the *tls.Conn).
	// conn carries the probe's deadline; any bytes the proxy sent after its
	// response head are read first. Exchange must honour ctx for anything
	// it waits on other than conn, and must not keep conn after it returns;
	// Probe closes it. A non-nil error fails the probe as
	// KindTunnelFailed. Zero: no exchange.
	Exchange func(ctx context.Context, conn net.Conn) error

	// DialContext opens the TCP connection to the proxy (network is
	// "tcp"). Zero: a net.Dialer's, without TCP keep-alives (probe
	// connections are short).
	DialContext func(ctx context.Context, network, address string) (net.Conn, error)

	// ProxyTLS, when not nil, makes the connection to the proxy TLS (an
	// HTTPS proxy): the handshake comes before the CONNECT request, and
	// its failure (an untrusted certificate, one for another name, a
	// proxy that does not speak TLS) is KindTLS. Trust the proxy's CA with
	// RootCAs. When ProxyTLS.ServerName is empty it is set to the proxy's
	// host (on a clone; ProxyTLS is never modified). Zero: plain TCP.
	ProxyTLS *tls.Config

	// EgressURL, when set, is an http or https URL that answers a GET
	// with the address it was asked from, as plain text ("what is my
	// address"). After a successful probe, Probe opens a second tunnel
	// through the proxy (same credentials, ProxyTLS and deadline) to the
	// URL's host and port, GETs the URL and reports the address in
	// Result.EgressAddress: where the proxy's traffic leaves from. The
	// fetch's failure is Result.EgressErr; it does not fail the probe.
	// The URL must not carry credentials. Zero: no fetch.
	EgressURL string
	// EgressTLS is the TLS configuration of an https EgressURL; an empty
	// ServerName is set to the URL's host (on a clone). Nil: the
	// system's roots.
	EgressTLS *tls.Config
}

// Result is the outcome of one probe.
type Result struct {
	// ID is the Proxy.ID the result belongs to (set by ProbeAll and
	// Tracker.Round; empty for Probe).
	ID string
	// Proxy and Target are the proxy address and the CONNECT target.
	Proxy  string
	Target string

	// OK is true only when the proxy answered 2xx and the tunnel proof,
	// if any, succeeded.
	OK bool
	// Kind classifies the failure; KindNone when OK.
	Kind Kind
	// StatusCode is the proxy's final status code, 0 when none was read.
	StatusCode int
	// Err is nil when OK, else a *ProbeError with the same Kind.
	Err error

	// Start is when the probe began (wall clock).
	Start time.Time
	// Connect is the time the TCP connect to the proxy took.
	Connect time.Duration
	// FirstByte is the time from Start to the first byte of the proxy's
	// answer (time to first byte, connect included); 0 if none arrived.
	FirstByte time.Duration
	// Total is the time from Start until the probe finished (tunnel proof
	// included, egress fetch not).
	Total time.Duration

	// EgressAddress is the address ProbeOptions.EgressURL answered
	// through the proxy: where its traffic leaves from. The zero Addr
	// (not valid) when no EgressURL was given, the probe failed or the
	// fetch failed.
	EgressAddress netip.Addr
	// EgressErr is the egress fetch's failure, a *ProbeError whose Target
	// is the URL's host and port; nil when the fetch succeeded or did not
	// run. It never makes OK false.
	EgressErr error
}

// Latency is the probe's total duration (Total).
func (r Result) Latency() time.Duration { return r.Total }

type probeState struct {
	req     []byte
	scratch []byte
	br      *bufio.Reader
	wg      sync.WaitGroup
}

var statePool = sync.Pool{New: func() any {
	return &probeState{
		req:     make([]byte, 0, 256),
		scratch: make([]byte, 0, 64),
		br:      bufio.NewReaderSize(nil, readBufSize),
	}
}}

var defaultDialer = &net.Dialer{KeepAlive: -1}

// aLongTimeAgo is a deadline in the past: it unblocks pending I/O at once.
var aLongTimeAgo = time.Unix(1, 0)

// Probe opens a TCP connection to the HTTP proxy at proxy (host:port),
// sends "CONNECT target HTTP/1.1" and reads the proxy's answer. It
// succeeds only when the final status line is 2xx and the optional tunnel
// proof (opts.TLS, opts.Exchange) succeeds. Failures are classified in
// Result.Kind.
//
// Probe never blocks past ctx or the probe's timeout: the connection's
// deadline is set from both, and the connection is shut down as soon as ctx
// is done. Probe starts no goroutine of its own (the context package runs a
// short callback if ctx ends during the probe; Probe waits for it) and
// always closes the connection before it returns.
func Probe(ctx context.Context, proxy, target string, opts *ProbeOptions) Result {
	start := time.Now()
	res := Result{Proxy: proxy, Target: target, Start: start}
	var o ProbeOptions
	if opts != nil {
		o = *opts
	}
	if err := validateProbe(proxy, target, &o); err != nil {
		return res.fail(KindBadInput, "input", err)
	}
	var deadline time.Time
	if o.Timeout >= 0 {
		t := o.Timeout
		if t == 0 {
			t = defaultTimeout
		}
		deadline = start.Add(t)
	}
	if d, ok := ctx.Deadline(); ok && (deadline.IsZero() || d.Before(deadline)) {
		deadline = d
	}
	if ctx.Err() != nil {
		return res.fail(classify(ctx, ctx.Err()), "dial", context.Cause(ctx))
	}

	conn, err := dial(ctx, o.DialContext, proxy, deadline)
	res.Connect = time.Since(start)
	if err != nil {
		return res.fail(classify(ctx, err), "dial", err)
	}

	st := statePool.Get().(*probeState)
	var stop func() bool
	if ctx.Done() != nil {
		st.wg.Add(1)
		stop = context.AfterFunc(ctx, func() {
			defer st.wg.Done()
			conn.SetDeadline(aLongTimeAgo)
			conn.Close()
		})
	}
	res = probeConn(ctx, conn, st, target, deadline, &o, res)
	conn.Close()
	if stop != nil {
		if stop() {
			st.wg.Done()
		}
		st.wg.Wait()
	}
	st.br.Reset(nil)
	statePool.Put(st)
	if res.OK && o.EgressURL != "" {
		res.EgressAddress, res.EgressErr = fetchEgress(ctx, proxy, &o, deadline)
	}
	return res
}

// probeConn runs the CONNECT exchange and the tunnel proof on conn.
func probeConn(ctx context.Context, conn net.Conn, st *probeState, target string, deadline time.Time, o *ProbeOptions, res Result) Result {
	if !deadline.IsZero() {
		if err := conn.SetDeadline(deadline); err != nil {
			return res.fail(classify(ctx, err), "dial", err)
		}
	}
	if o.ProxyTLS != nil {
		tc := tls.Client(conn, serverName(o.ProxyTLS, res.Proxy))
		// The deadline and the context's callback (which closes conn)
		// bound the handshake; Handshake starts no goroutine.
		if err := tc.Handshake(); err != nil {
			return res.fail(classifyTLS(ctx, err), "handshake", err)
		}
		conn = tc
	}
	if err := writeConnect(conn, st, target, o); err != nil {
		return res.fail(classify(ctx, err), "write", err)
	}

	br := st.br
	br.Reset(conn)
	if _, err := br.Peek(1); err != nil {
		if err == io.EOF {
			return res.fail(classifyClosed(ctx), "read", errors.New("proxy closed the connection without answering"))
		}
		return res.fail(classify(ctx, err), "read", err)
	}
	res.FirstByte = time.Since(res.Start)
	code, err := readResponseHead(br)
	if err != nil {
		return res.fail(classifyHead(ctx, err), "read", err)
	}
	res.StatusCode = code
	switch {
	case code == 407:
		return res.fail(KindAuthRequired, "read", nil)
	case code < 200 || code > 299:
		return res.fail(KindProxyStatus, "read", nil)
	}

	if o.TLS != nil || o.Exchange != nil {
		if err := proveTunnel(ctx, conn, br, target, deadline, o); err != nil {
			k := KindTunnelFailed
			if ctx.Err() != nil && errors.Is(ctx.Err(), context.Canceled) {
				k = KindCanceled
			}
			return res.fail(k, "tunnel", err)
		}
	}
	res.OK = true
	res.Total = time.Since(res.Start)
	return res
}

// writeConnect sends the CONNECT request for target, with the basic
// credentials of o when it has a Username. The request is built in st's
// pooled buffers; the bytes holding credentials are cleared after use.
func writeConnect(conn net.Conn, st *probeState, target string, o *ProbeOptions) error {
	b := append(st.req[:0], "CONNECT "...)
	b = append(b, target...)
	b = append(b, " HTTP/1.1\r\nHost: "...)
	b = append(b, target...)
	b = append(b, "\r\n"...)
	if o.Username != "" {
		cred := append(st.scratch[:0], o.Username...)
		cred = append(cred, ':')
		cred = append(cred, o.Password...)
		b = append(b, "Proxy-Authorization: Basic "...)
		b = base64.StdEncoding.AppendEncode(b, cred)
		b = append(b, "\r\n"...)
		clear(cred)
		st.scratch = cred[:0]
	}
	b = append(b, "\r\n"...)
	st.req = b[:0]
	_, err := conn.Write(b)
	if o.Username != "" {
		clear(b) // do not keep credentials in pooled memory
	}
	return err
}

// classifyHead maps an error of readResponseHead to a Kind. A head cut
// short is malformed unless ctx ended, which caused it.
func classifyHead(ctx context.Context, err error) Kind {
	var me *malformedError
	switch {
	case errors.As(err, &me):
		return KindMalformed
	case err == errTruncated:
		if k := classifyClosed(ctx); k != KindNetwork {
			return k
		}
		return KindMalformed
	case err == io.EOF:
		return classifyClosed(ctx)
	}
	return classify(ctx, err)
}

func proveTunnel(ctx context.Context, conn net.Conn, br *bufio.Reader, target string, deadline time.Time, o *ProbeOptions) error {
	var tc net.Conn = conn
	if br.Buffered() > 0 {
		tc = &bufferedConn{Conn: conn, r: br}
	}
	if !deadline.IsZero() {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, deadline)
		defer cancel()
	}
	if o.TLS != nil {
		tlsConn := tls.Client(tc, serverName(o.TLS, target))
		if err := tlsConn.HandshakeContext(ctx); err != nil {
			return err
		}
		tc = tlsConn
	}
	if o.Exchange != nil {
		return o.Exchange(ctx, tc)
	}
	return nil
}

// serverName returns cfg, or a clone of it naming the host of address
// when its ServerName is empty.
func serverName(cfg *tls.Config, address string) *tls.Config {
	if cfg.ServerName != "" {
		return cfg
	}
	host, _, _ := net.SplitHostPort(address)
	cfg = cfg.Clone()
	cfg.ServerName = host
	return cfg
}

// classifyTLS maps an error of the TLS handshake with the proxy to a
// Kind: caused by ctx or the deadline, or else KindTLS.
func classifyTLS(ctx context.Context, err error) Kind {
	if ctx.Err() != nil {
		return classify(ctx, err)
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return KindTimeout
	}
	return KindTLS
}

// bufferedConn hands the bytes buffered after the response head to the
// tunnel proof before reading from the connection.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufferedConn) Read(p []byte) (int, error) {
	if c.r.Buffered() > 0 {
		return c.r.Read(p)
	}
	return c.Conn.Read(p)
}

func dial(ctx context.Context, dialContext func(ctx context.Context, network, address string) (net.Conn, error), address string, deadline time.Time) (net.Conn, error) {
	if dialContext == nil {
		dialContext = defaultDialer.DialContext
	}
	if !deadline.IsZero() {
		if cd, ok := ctx.Deadline(); !ok || deadline.Before(cd) {
			var cancel context.CancelFunc
			ctx, cancel = context.WithDeadline(ctx, deadline)
			defer cancel()
		}
	}
	return dialContext(ctx, "tcp", address)
}

func (r Result) fail(k Kind, op string, err error) Result {
	r.OK = false
	r.Kind = k
	r.Err = &ProbeError{Kind: k, Op: op, Proxy: r.Proxy, Target: r.Target, StatusCode: r.StatusCode, Err: err}
	r.Total = time.Since(r.Start)
	return r
}

// classify maps an error of the dial or of connection I/O to a Kind. The
// context's state wins: an error after ctx ended is caused by ctx.
func classify(ctx context.Context, err error) Kind {
	if cerr := ctx.Err(); cerr != nil {
		if errors.Is(cerr, context.Canceled) {
			return KindCanceled
		}
		return KindTimeout
	}
	var dnsErr *net.DNSError
	switch {
	case errors.As(err, &dnsErr):
		return KindDNS
	case errors.Is(err, syscall.ECONNREFUSED):
		return KindRefused
	case errors.Is(err, os.ErrDeadlineExceeded), errors.Is(err, context.DeadlineExceeded):
		return KindTimeout
	case errors.Is(err, context.Canceled):
		return KindCanceled
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return KindTimeout
	}
	return KindNetwork
}

// classifyClosed classifies a connection that ended (EOF): caused by ctx if
// ctx ended, else a network failure.
func classifyClosed(ctx context.Context) Kind {
	if ctx.Err() != nil {
		return classify(ctx, ctx.Err())
	}
	return KindNetwork
}

// validateProbe checks Probe's input. The option fields are named by their
// Go field in ProbeOptions.
func validateProbe(proxy, target string, o *ProbeOptions) error {
	if proxy == "" {
		return errors.New("proxy address: must not be empty")
	}
	if _, port, err := net.SplitHostPort(proxy); err != nil || port == "" {
		return errors.New("proxy address: must be host:port, got " + quote(proxy))
	}
	host, port, err := net.SplitHostPort(target)
	if err != nil || host == "" || port == "" {
		return errors.New("target: must be host:port with a non-empty host and port, got " + quote(target))
	}
	for i := 0; i < len(target); i++ {
		if c := target[i]; c <= ' ' || c == 0x7f {
			return errors.New("target: must not contain spaces or control bytes, got " + quote(target))
		}
	}
	if strings.IndexByte(o.Username, ':') >= 0 {
		// No Value: a Username with ':' may be "user:password" pasted whole.
		return &errs.FieldError{Field: "Username", Rule: "must not contain ':' (RFC 7617 basic auth)"}
	}
	if o.Username == "" && o.Password != "" {
		return &errs.FieldError{Field: "Password", Rule: "is set without a Username"}
	}
	if o.EgressURL != "" {
		if _, _, err := egressTarget(o.EgressURL); err != nil {
			return err
		}
	}
	return nil
}

func quote(s string) string {
	const max = 64
	if len(s) > max {
		s = s[:max] + "..."
	}
	return strconv.Quote(s)
}
