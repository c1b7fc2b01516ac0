package loopback

import "testing"

func TestHostPort(t *testing.T) {
	for hp, want := range map[string]bool{
		"127.0.0.1:80": true, "127.9.9.9:1": true, "[::1]:7070": true, "localhost:3128": true,
		"192.0.2.1:80": false, "example.org:80": false, "127.0.0.1": false, "": false, "[::]:80": false,
	} {
		if got := HostPort(hp); got != want {
			t.Errorf("HostPort(%q) = %v, want %v", hp, got, want)
		}
	}
}
