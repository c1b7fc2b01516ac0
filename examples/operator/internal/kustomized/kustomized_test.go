package kustomized

import (
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
)

func TestProcessArgs(t *testing.T) {
	c := &corev1.Container{Args: []string{"--entries=/etc/e.yaml", "--metrics-bind-address=:8080", "--connect-target=example.com:443"}}
	got, err := ProcessArgs(c, map[string]string{"entries": "/tmp/e.yaml", "metrics-bind-address": "127.0.0.1:9"}, "--kubeconfig=/k")
	if err != nil {
		t.Fatal(err)
	}
	if want := "--entries=/tmp/e.yaml --metrics-bind-address=127.0.0.1:9 --connect-target=example.com:443 --kubeconfig=/k"; strings.Join(got, " ") != want {
		t.Errorf("got %q, want %q", got, want)
	}
	if _, err := ProcessArgs(c, map[string]string{"health-probe-bind-address": "127.0.0.1:9"}); err == nil {
		t.Error("a flag the Deployment does not pass was replaced without error")
	}
	if _, err := ProcessArgs(&corev1.Container{Args: []string{"--entries", "/etc/e.yaml"}}, nil); err == nil {
		t.Error("an arg that is not --name=value was taken")
	}
	if v, ok := Flag(c.Args, "connect-target"); !ok || v != "example.com:443" {
		t.Errorf("Flag: %q %v", v, ok)
	}
}
