package health

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net/http"
	"testing"
	"testing/iotest"
)

type headOutcome struct {
	code int
	err  string // "", "eof", "truncated", "malformed"
	rest []byte
}

func parseHead(r io.Reader) headOutcome {
	br := bufio.NewReaderSize(r, readBufSize)
	code, err := readResponseHead(br)
	var out headOutcome
	var me *malformedError
	switch {
	case err == nil:
		out.code = code
		out.rest, _ = io.ReadAll(br)
	case err == io.EOF:
		out.err = "eof"
	case err == errTruncated:
		out.err = "truncated"
	case errors.As(err, &me):
		out.err = "malformed"
	default:
		out.err = "unexpected: " + err.Error()
	}
	return out
}

// FuzzReadResponseHead checks the CONNECT response-head reader: it never
// panics, fails only with its own error classes, does not depend on how the
// bytes are chunked, leaves exactly the bytes after the head for the tunnel,
// and agrees with net/http on the status code of heads both accept.
func FuzzReadResponseHead(f *testing.F) {
	for _, s := range []string{
		"HTTP/1.1 200 Connection established\r\n\r\n",
		"HTTP/1.0 200 OK\r\nVia: 1.1 squid\r\n\r\ntunnel bytes",
		"HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=\"x\"\r\n\r\n",
		"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\n",
		"HTTP/1.1 2OO OK\r\n\r\n",
		"HTTP/1.1 200 OK\n\n",
		"HTTP/1.1 200 OK\r\nX: y\r\n",
		"",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		got := parseHead(bytes.NewReader(data))
		if len(got.err) > 10 {
			t.Fatalf("unexpected error class %s", got.err)
		}
		if one := parseHead(iotest.OneByteReader(bytes.NewReader(data))); one.code != got.code || one.err != got.err || !bytes.Equal(one.rest, got.rest) {
			t.Fatalf("chunking changed the outcome: %+v vs %+v", got, one)
		}
		if got.err != "" {
			if got.err == "eof" && len(data) != 0 {
				t.Fatalf("eof with %d bytes of input", len(data))
			}
			return
		}
		if got.code != 101 && (got.code < 200 || got.code > 599) {
			t.Fatalf("final code %d", got.code)
		}
		head := data[:len(data)-len(got.rest)]
		if !bytes.Equal(got.rest, data[len(head):]) {
			t.Fatal("rest is not the suffix of the input")
		}
		if !bytes.HasSuffix(head, []byte("\n\n")) && !bytes.HasSuffix(head, []byte("\n\r\n")) {
			t.Fatalf("head %q does not end with a blank line", head)
		}
		if c, err := parseStatusLine(head[:bytes.IndexByte(head, '\n')+1]); err != nil || c < 100 {
			t.Fatalf("first line of an accepted head does not parse: %v", err)
		}
		if got.code >= 200 && bytes.HasPrefix(head, []byte("HTTP/1.")) {
			if resp, err := http.ReadResponse(bufio.NewReader(bytes.NewReader(head)), nil); err == nil {
				resp.Body.Close()
				if resp.StatusCode != got.code && resp.StatusCode >= 200 {
					t.Fatalf("net/http reads status %d, we read %d", resp.StatusCode, got.code)
				}
			}
		}
	})
}

func TestParseStatusLine(t *testing.T) {
	t.Parallel()
	tests := []struct {
		line string
		code int // 0: must fail
	}{
		{"HTTP/1.1 200 Connection established\r\n", 200},
		{"HTTP/1.0 200\r\n", 200},
		{"HTTP/1.1 407 Proxy Authentication Required\n", 407},
		{"HTTP/1.1 599 x", 599},
		{"HTTP/1.1 600 x\r\n", 0},
		{"HTTP/1.1 099 x\r\n", 0},
		{"HTTP/2.0 200 OK\r\n", 0},
		{"HTTP/1.1  200 OK\r\n", 0},
		{"HTTP/1.1 20 OK\r\n", 0},
		{"HTTP/1.1 200OK\r\n", 0},
		{"HTTP/1.x 200 OK\r\n", 0},
		{"http/1.1 200 OK\r\n", 0},
		{"HTTP/1.1 200 O\rK\r\n", 0},
		{"", 0},
	}
	for _, tt := range tests {
		t.Run(tt.line, func(t *testing.T) {
			code, err := parseStatusLine([]byte(tt.line))
			if tt.code == 0 {
				if err == nil {
					t.Fatalf("accepted with code %d", code)
				}
				return
			}
			if err != nil || code != tt.code {
				t.Fatalf("got %d, %v; want %d", code, err, tt.code)
			}
		})
	}
}
