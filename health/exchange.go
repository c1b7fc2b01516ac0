package health

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
)

// maxExchangeBody bounds how much of the target's answer HTTPGet reads.
const maxExchangeBody = 1 << 10

// HTTPGet returns a tunnel proof for ProbeOptions.Exchange: it sends
// "GET / HTTP/1.1" with the given Host through the established tunnel and
// succeeds only when the target answers 200 with exactly wantBody (at most
// 1 KiB is read). Use it when the probe target is a plain HTTP server the
// embedder controls, so a probe proves that bytes really cross the proxy.
// The connection's deadline (set by Probe from ctx) bounds the exchange.
func HTTPGet(host, wantBody string) func(ctx context.Context, conn net.Conn) error {
	return func(_ context.Context, conn net.Conn) error {
		if _, err := io.WriteString(conn, "GET / HTTP/1.1\r\nHost: "+host+"\r\nConnection: close\r\n\r\n"); err != nil {
			return err
		}
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(io.LimitReader(resp.Body, maxExchangeBody))
		if err != nil {
			return err
		}
		if resp.StatusCode != http.StatusOK || string(body) != wantBody {
			return fmt.Errorf("target answered %s %q through the tunnel, want 200 %q", resp.Status, body, wantBody)
		}
		return nil
	}
}
