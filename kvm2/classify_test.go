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

	"github.com/egressproxy/egressproxy"
	"github.com/egressproxy/egressproxy/internal/errs"
	"github.com/egressproxy/egressproxy/sshconn"
)

func lvErr(code libvirt.ErrorNumber) error {
	return libvirt.Error{Code: uint32(code), Message: fmt.Sprintf("libvirt error %d", code)}
}

func sshErr(k sshconn.Kind, inner error) error {
	return &sshconn.Error{Kind: k, Address: "127.0.0.1:22", Op: "test", Err: inner}
}

func TestClassify(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		err  error
		want errs.ErrorCode
		read errs.ErrorCode // classifyRead; zero means same as want
	}{
		{"nil", nil, errs.OK, 0},
		{"explicit transient wins over no-domain", errs.WithCode(errs.Transient, lvErr(libvirt.ErrNoDomain)), errs.Transient, 0},
		{"explicit permanent wins over rpc", errs.WithCode(errs.Permanent, lvErr(libvirt.ErrRPC)), errs.Permanent, errs.Permanent},
		{"explicit not found wrapped", fmt.Errorf("ctx: %w", errs.WithCode(errs.NotFound, errors.New("x"))), errs.NotFound, 0},
		{"canceled", context.Canceled, errs.Canceled, 0},
		{"deadline", fmt.Errorf("call: %w", context.DeadlineExceeded), errs.DeadlineExceeded, 0},
		{"sshconn unreachable around ctx deadline", sshErr(sshconn.KindUnreachable, context.DeadlineExceeded), errs.DeadlineExceeded, 0},
		{"no domain", lvErr(libvirt.ErrNoDomain), errs.NotFound, 0},
		{"no storage vol", fmt.Errorf("lookup: %w", lvErr(libvirt.ErrNoStorageVol)), errs.NotFound, 0},
		{"no storage pool", lvErr(libvirt.ErrNoStoragePool), errs.Permanent, errs.Permanent},
		{"no domain metadata", lvErr(libvirt.ErrNoDomainMetadata), errs.NotFound, 0},
		{"invalid arg", lvErr(libvirt.ErrInvalidArg), errs.Permanent, errs.Transient},
		{"access denied", lvErr(libvirt.ErrAccessDenied), errs.Permanent, errs.Permanent},
		{"no support", lvErr(libvirt.ErrNoSupport), errs.Permanent, errs.Transient},
		{"operation invalid", lvErr(libvirt.ErrOperationInvalid), errs.Permanent, errs.Transient},
		{"operation unsupported", lvErr(libvirt.ErrOperationUnsupported), errs.Permanent, errs.Transient},
		{"xml error", lvErr(libvirt.ErrXMLError), errs.Permanent, errs.Transient},
		{"dom exists", lvErr(libvirt.ErrDomExist), errs.Permanent, errs.Transient},
		{"procedure unsupported", libvirt.ErrUnsupported, errs.Permanent, errs.Transient},
		{"rpc", lvErr(libvirt.ErrRPC), errs.Transient, 0},
		{"no connect", lvErr(libvirt.ErrNoConnect), errs.Transient, 0},
		{"internal error", lvErr(libvirt.ErrInternalError), errs.Transient, 0},
		{"system error", lvErr(libvirt.ErrSystemError), errs.Transient, 0},
		{"operation timeout", lvErr(libvirt.ErrOperationTimeout), errs.Transient, 0},
		{"agent unresponsive", lvErr(libvirt.ErrAgentUnresponsive), errs.Transient, 0},
		{"resource busy", lvErr(libvirt.ErrResourceBusy), errs.Transient, 0},
		{"unknown libvirt code", lvErr(libvirt.ErrorNumber(9999)), errs.Transient, 0},
		// The link died: transient wins over any code it carries.
		{"link dead wraps invalid arg", sshErr(sshconn.KindUnreachable, lvErr(libvirt.ErrInvalidArg)), errs.Transient, 0},
		{"link dead wraps access denied", sshErr(sshconn.KindUnreachable, lvErr(libvirt.ErrAccessDenied)), errs.Transient, 0},
		{"go-libvirt EINVAL after disconnect", fmt.Errorf("get state: %w", syscall.EINVAL), errs.Transient, 0},
		{"interrupted", libvirt.ErrInterrupted, errs.Transient, 0},
		{"eof", io.EOF, errs.Transient, 0},
		{"net closed", net.ErrClosed, errs.Transient, 0},
		{"net op error", &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}, errs.Transient, 0},
		{"ssh forbidden", sshErr(sshconn.KindForbidden, errors.New("open failed")), errs.Transient, 0},
		{"ssh auth refused", sshErr(sshconn.KindAuthRefused, errors.New("unable to authenticate")), errs.Permanent, errs.Permanent},
		{"ssh host unknown", sshErr(sshconn.KindHostUnknown, nil), errs.Permanent, errs.Permanent},
		{"ssh host mismatch", sshErr(sshconn.KindHostKeyMismatch, nil), errs.Permanent, errs.Permanent},
		{"ssh key unreadable", sshErr(sshconn.KindKeyUnreadable, nil), errs.Permanent, errs.Permanent},
		{"ssh closed", sshErr(sshconn.KindClosed, nil), errs.Permanent, errs.Permanent},
		{"plain error", errors.New("something"), errs.Transient, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := classify(tt.err)
			if c := errs.Code(got); c != tt.want {
				t.Errorf("classify(%v) = %v, want %v", tt.err, c, tt.want)
			}
			if tt.err != nil && !errors.Is(got, tt.err) {
				t.Errorf("classify lost the cause: %v", got)
			}
			wantRead := tt.read
			if wantRead == 0 {
				wantRead = tt.want
			}
			if c := errs.Code(classifyRead(tt.err)); c != wantRead {
				t.Errorf("classifyRead(%v) = %v, want %v", tt.err, c, wantRead)
			}
		})
	}
}

func TestClassifyClosedIsErrClosed(t *testing.T) {
	t.Parallel()
	err := classify(sshErr(sshconn.KindClosed, nil))
	if !errors.Is(err, errs.ErrClosed) {
		t.Errorf("%v does not match errs.ErrClosed", err)
	}
}

func TestHealthReason(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		err  error
		want egressproxy.HealthReason
	}{
		{"key unreadable", sshErr(sshconn.KindKeyUnreadable, nil), egressproxy.ReasonCredentialsUnavailable},
		{"auth refused", sshErr(sshconn.KindAuthRefused, nil), egressproxy.ReasonUnauthorized},
		{"host unknown", sshErr(sshconn.KindHostUnknown, nil), egressproxy.ReasonHostKeyUnknown},
		{"host mismatch", sshErr(sshconn.KindHostKeyMismatch, nil), egressproxy.ReasonHostKeyMismatch},
		{"socket refused", sshErr(sshconn.KindForbidden, nil), egressproxy.ReasonForbidden},
		{"unreachable", sshErr(sshconn.KindUnreachable, nil), egressproxy.ReasonUnreachable},
		{"unreachable wrapping access denied", sshErr(sshconn.KindUnreachable, lvErr(libvirt.ErrAccessDenied)), egressproxy.ReasonUnreachable},
		{"libvirt access denied", lvErr(libvirt.ErrAccessDenied), egressproxy.ReasonForbidden},
		{"libvirt auth failed", lvErr(libvirt.ErrAuthFailed), egressproxy.ReasonForbidden},
		{"pool not found", fmt.Errorf("lookup: %w", lvErr(libvirt.ErrNoStoragePool)), egressproxy.ReasonPoolNotFound},
		{"pool not active", fmt.Errorf("pool: %w", errPoolNotActive), egressproxy.ReasonPoolNotActive},
		{"eof", io.EOF, egressproxy.ReasonUnreachable},
		{"rpc", lvErr(libvirt.ErrRPC), egressproxy.ReasonUnreachable},
		{"other", errors.New("odd"), egressproxy.ReasonUnknown},
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
