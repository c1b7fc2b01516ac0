package kvm2

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"testing"

	libvirt "github.com/digitalocean/go-libvirt"

	"github.com/egressproxy/egressproxy/provider"
	"github.com/egressproxy/egressproxy/sshconn"
)

func lvErr(code libvirt.ErrorNumber) error {
	return libvirt.Error{Code: uint32(code), Message: fmt.Sprintf("libvirt error %d", code)}
}

func sshErr(k sshconn.Kind, inner error) error {
	return &sshconn.Error{Kind: k, Addr: "127.0.0.1:22", Op: "test", Err: inner}
}

func TestClassify(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		err  error
		want provider.ErrorCode
		read provider.ErrorCode // classifyRead; zero means same as want
	}{
		{"nil", nil, provider.OK, 0},
		{"explicit transient wins over no-domain", provider.WithCode(provider.Transient, lvErr(libvirt.ErrNoDomain)), provider.Transient, 0},
		{"explicit permanent wins over rpc", provider.WithCode(provider.Permanent, lvErr(libvirt.ErrRPC)), provider.Permanent, provider.Permanent},
		{"explicit not found wrapped", fmt.Errorf("ctx: %w", provider.WithCode(provider.NotFound, errors.New("x"))), provider.NotFound, 0},
		{"canceled", context.Canceled, provider.Canceled, 0},
		{"deadline", fmt.Errorf("call: %w", context.DeadlineExceeded), provider.DeadlineExceeded, 0},
		{"sshconn unreachable around ctx deadline", sshErr(sshconn.KindUnreachable, context.DeadlineExceeded), provider.DeadlineExceeded, 0},
		{"no domain", lvErr(libvirt.ErrNoDomain), provider.NotFound, 0},
		{"no storage vol", fmt.Errorf("lookup: %w", lvErr(libvirt.ErrNoStorageVol)), provider.NotFound, 0},
		{"no storage pool", lvErr(libvirt.ErrNoStoragePool), provider.Permanent, provider.Transient},
		{"no domain metadata", lvErr(libvirt.ErrNoDomainMetadata), provider.NotFound, 0},
		{"invalid arg", lvErr(libvirt.ErrInvalidArg), provider.Permanent, provider.Transient},
		{"access denied", lvErr(libvirt.ErrAccessDenied), provider.Permanent, provider.Transient},
		{"no support", lvErr(libvirt.ErrNoSupport), provider.Permanent, provider.Transient},
		{"operation invalid", lvErr(libvirt.ErrOperationInvalid), provider.Permanent, provider.Transient},
		{"operation unsupported", lvErr(libvirt.ErrOperationUnsupported), provider.Permanent, provider.Transient},
		{"xml error", lvErr(libvirt.ErrXMLError), provider.Permanent, provider.Transient},
		{"dom exists", lvErr(libvirt.ErrDomExist), provider.Permanent, provider.Transient},
		{"procedure unsupported", libvirt.ErrUnsupported, provider.Permanent, provider.Transient},
		{"rpc", lvErr(libvirt.ErrRPC), provider.Transient, 0},
		{"no connect", lvErr(libvirt.ErrNoConnect), provider.Transient, 0},
		{"internal error", lvErr(libvirt.ErrInternalError), provider.Transient, 0},
		{"system error", lvErr(libvirt.ErrSystemError), provider.Transient, 0},
		{"operation timeout", lvErr(libvirt.ErrOperationTimeout), provider.Transient, 0},
		{"agent unresponsive", lvErr(libvirt.ErrAgentUnresponsive), provider.Transient, 0},
		{"resource busy", lvErr(libvirt.ErrResourceBusy), provider.Transient, 0},
		{"unknown libvirt code", lvErr(libvirt.ErrorNumber(9999)), provider.Transient, 0},
		// The link died: transient wins over any code it carries.
		{"link dead wraps invalid arg", sshErr(sshconn.KindUnreachable, lvErr(libvirt.ErrInvalidArg)), provider.Transient, 0},
		{"link dead wraps access denied", sshErr(sshconn.KindUnreachable, lvErr(libvirt.ErrAccessDenied)), provider.Transient, 0},
		{"go-libvirt EINVAL after disconnect", fmt.Errorf("get state: %w", syscall.EINVAL), provider.Transient, 0},
		{"interrupted", libvirt.ErrInterrupted, provider.Transient, 0},
		{"eof", io.EOF, provider.Transient, 0},
		{"net closed", net.ErrClosed, provider.Transient, 0},
		{"net op error", &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}, provider.Transient, 0},
		{"ssh forbidden", sshErr(sshconn.KindForbidden, errors.New("open failed")), provider.Transient, 0},
		{"ssh auth refused", sshErr(sshconn.KindAuthRefused, errors.New("unable to authenticate")), provider.Permanent, provider.Transient},
		{"ssh host unknown", sshErr(sshconn.KindHostUnknown, nil), provider.Permanent, provider.Transient},
		{"ssh host mismatch", sshErr(sshconn.KindHostKeyMismatch, nil), provider.Permanent, provider.Transient},
		{"ssh key unreadable", sshErr(sshconn.KindKeyUnreadable, nil), provider.Permanent, provider.Transient},
		{"ssh closed", sshErr(sshconn.KindClosed, nil), provider.Permanent, provider.Permanent},
		{"plain error", errors.New("something"), provider.Transient, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := classify(tt.err)
			if c := provider.Code(got); c != tt.want {
				t.Errorf("classify(%v) = %v, want %v", tt.err, c, tt.want)
			}
			if tt.err != nil && !errors.Is(got, tt.err) {
				t.Errorf("classify lost the cause: %v", got)
			}
			wantRead := tt.read
			if wantRead == 0 {
				wantRead = tt.want
			}
			if c := provider.Code(classifyRead(tt.err)); c != wantRead {
				t.Errorf("classifyRead(%v) = %v, want %v", tt.err, c, wantRead)
			}
		})
	}
}

func TestClassifyClosedIsErrClosed(t *testing.T) {
	t.Parallel()
	err := classify(sshErr(sshconn.KindClosed, nil))
	if !errors.Is(err, provider.ErrClosed) {
		t.Errorf("%v does not match provider.ErrClosed", err)
	}
}

func TestHealthReason(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		err  error
		want provider.HealthReason
	}{
		{"key unreadable", sshErr(sshconn.KindKeyUnreadable, nil), provider.ReasonCredentialsUnavailable},
		{"auth refused", sshErr(sshconn.KindAuthRefused, nil), provider.ReasonUnauthorized},
		{"host unknown", sshErr(sshconn.KindHostUnknown, nil), provider.ReasonHostKeyUnknown},
		{"host mismatch", sshErr(sshconn.KindHostKeyMismatch, nil), provider.ReasonHostKeyMismatch},
		{"socket refused", sshErr(sshconn.KindForbidden, nil), provider.ReasonForbidden},
		{"unreachable", sshErr(sshconn.KindUnreachable, nil), provider.ReasonUnreachable},
		{"unreachable wrapping access denied", sshErr(sshconn.KindUnreachable, lvErr(libvirt.ErrAccessDenied)), provider.ReasonUnreachable},
		{"libvirt access denied", lvErr(libvirt.ErrAccessDenied), provider.ReasonForbidden},
		{"libvirt auth failed", lvErr(libvirt.ErrAuthFailed), provider.ReasonForbidden},
		{"pool not found", fmt.Errorf("lookup: %w", lvErr(libvirt.ErrNoStoragePool)), provider.ReasonPoolNotFound},
		{"pool not active", fmt.Errorf("pool: %w", errPoolNotActive), provider.ReasonPoolNotActive},
		{"eof", io.EOF, provider.ReasonUnreachable},
		{"rpc", lvErr(libvirt.ErrRPC), provider.ReasonUnreachable},
		{"other", errors.New("odd"), provider.ReasonUnknown},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := healthReason(tt.err); got != tt.want {
				t.Errorf("healthReason(%v) = %q, want %q", tt.err, got, tt.want)
			}
		})
	}
}

func TestFormatting(t *testing.T) {
	t.Parallel()
	if got := formatLibVersion(9000000); got != "9.0.0" {
		t.Errorf("formatLibVersion(9000000) = %q", got)
	}
	if got := formatLibVersion(10010003); got != "10.10.3" {
		t.Errorf("formatLibVersion(10010003) = %q", got)
	}
	if got := formatGiB(3 << 29); got != "1.50" {
		t.Errorf("formatGiB = %q", got)
	}
	if got := poolStateName(2); got != "running" {
		t.Errorf("poolStateName(2) = %q", got)
	}
	if got := poolStateName(0); got != "inactive" {
		t.Errorf("poolStateName(0) = %q", got)
	}
}
