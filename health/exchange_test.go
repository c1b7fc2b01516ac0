package health

import (
	"context"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

func TestHTTPGet(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name   string
		answer string
		ok     bool
	}{
		{"token", "HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc", true},
		{"wrong body", "HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nxyz", false},
		{"not 200", "HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\n\r\nabc", false},
		{"garbage", "SSH-2.0-x\r\n", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			client, server := net.Pipe()
			defer client.Close()
			done := make(chan string, 1)
			go func() {
				defer server.Close()
				buf := make([]byte, 512)
				n, _ := server.Read(buf)
				io.WriteString(server, tt.answer)
				done <- string(buf[:n])
			}()
			client.SetDeadline(time.Now().Add(5 * time.Second))
			err := HTTPGet("127.0.0.1:9", "abc")(context.Background(), client)
			if (err == nil) != tt.ok {
				t.Fatalf("err = %v, want ok=%v", err, tt.ok)
			}
			if req := <-done; !strings.HasPrefix(req, "GET / HTTP/1.1\r\nHost: 127.0.0.1:9\r\n") {
				t.Fatalf("request = %q", req)
			}
		})
	}
}
