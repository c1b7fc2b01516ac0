package health

import (
	"bufio"
	"errors"
	"io"
)

const (
	// maxHeadBytes bounds the bytes of all response heads (interim + final)
	// read for one CONNECT answer.
	maxHeadBytes = 32 << 10
	// maxInterim bounds the number of 1xx interim responses skipped.
	maxInterim = 8
	// readBufSize is the size of the pooled bufio.Reader. The status line
	// must fit in it; longer header lines are skipped piecewise.
	readBufSize = 1024
)

// errTruncated marks a response head cut short by EOF after at least one
// byte; an EOF before any byte is returned as io.EOF.
var errTruncated = errors.New("connection closed in the middle of the response head")

// parseStatusLine parses an HTTP/1.x status line ("HTTP/1.1 200 OK\r\n").
// The line may end in "\r\n", "\n" or nothing. It returns the status code
// (100..599) or an error describing the defect.
func parseStatusLine(line []byte) (int, error) {
	line = trimEOL(line)
	// "HTTP/1.x SSS" is 12 bytes.
	if len(line) < 12 || string(line[:7]) != "HTTP/1." {
		return 0, errMalformed("status line does not start with HTTP/1.x")
	}
	if c := line[7]; c < '0' || c > '9' {
		return 0, errMalformed("bad HTTP version")
	}
	if line[8] != ' ' {
		return 0, errMalformed("no space after HTTP version")
	}
	code := 0
	for _, c := range line[9:12] {
		if c < '0' || c > '9' {
			return 0, errMalformed("status code is not three digits")
		}
		code = code*10 + int(c-'0')
	}
	if code < 100 || code > 599 {
		return 0, errMalformed("status code %d out of range", code)
	}
	if err := checkReason(line[12:]); err != nil {
		return 0, err
	}
	return code, nil
}

// trimEOL cuts a trailing "\n" or "\r\n".
func trimEOL(line []byte) []byte {
	n := len(line)
	if n > 0 && line[n-1] == '\n' {
		n--
		if n > 0 && line[n-1] == '\r' {
			n--
		}
	}
	return line[:n]
}

// checkReason checks what follows the status code: nothing, or a space and
// a reason phrase without CR, LF or NUL.
func checkReason(rest []byte) error {
	if len(rest) == 0 {
		return nil
	}
	if rest[0] != ' ' {
		return errMalformed("no space after status code")
	}
	for _, c := range rest[1:] {
		if c == '\r' || c == '\n' || c == 0 {
			return errMalformed("control byte in reason phrase")
		}
	}
	return nil
}

// readResponseHead reads the proxy's answer to CONNECT from br: interim 1xx
// responses (except 101) are skipped, then the final status line and its
// header lines up to and including the blank line. Everything after the
// blank line stays unread in br (it belongs to the tunnel).
//
// It returns the final status code. Errors: io.EOF when the connection
// ended before any byte, errTruncated when it ended inside the head, a
// *malformedError for a bad head, or the reader's error.
func readResponseHead(br *bufio.Reader) (code int, err error) {
	total := 0
	for interim := 0; ; interim++ {
		line, err := br.ReadSlice('\n')
		total += len(line)
		if err != nil {
			switch {
			case err == bufio.ErrBufferFull:
				return 0, errMalformed("status line longer than %d bytes", readBufSize)
			case err == io.EOF && total == 0:
				return 0, io.EOF
			case err == io.EOF:
				return 0, errTruncated
			}
			return 0, err
		}
		code, err = parseStatusLine(line)
		if err != nil {
			return 0, err
		}
		// Header lines until the blank line. A line longer than the
		// buffer arrives in pieces; only a piece that starts a line can be
		// the blank line.
		atLineStart := true
		for {
			line, err := br.ReadSlice('\n')
			total += len(line)
			if total > maxHeadBytes {
				return 0, errMalformed("response head larger than %d bytes", maxHeadBytes)
			}
			if err == bufio.ErrBufferFull {
				atLineStart = false
				continue
			}
			if err != nil {
				if err == io.EOF {
					return 0, errTruncated
				}
				return 0, err
			}
			if atLineStart && (len(line) == 1 || (len(line) == 2 && line[0] == '\r')) {
				break
			}
			atLineStart = true
		}
		if code >= 200 || code == 101 {
			return code, nil
		}
		if interim >= maxInterim {
			return 0, errMalformed("more than %d interim responses", maxInterim)
		}
	}
}
