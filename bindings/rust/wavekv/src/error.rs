use std::ffi::CStr;
use std::fmt;

use wavekv_sys as sys;

/// A failure's kind: one variant per `WKV_ERR_*` status of wavekv.h.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// A null pointer, zero size, bad stride or bad value (`WKV_ERR_INVALID_ARGUMENT`).
    InvalidArgument,
    /// A null, destroyed, closed or foreign handle (`WKV_ERR_INVALID_HANDLE`).
    InvalidHandle,
    /// An index (layer, head, token) past its bound (`WKV_ERR_OUT_OF_RANGE`).
    OutOfRange,
    /// A head_dim, dtype or device this build cannot serve (`WKV_ERR_UNSUPPORTED`).
    Unsupported,
    /// The configured byte budget would be exceeded (`WKV_ERR_BUDGET`).
    Budget,
    /// The host or device allocator failed (`WKV_ERR_OUT_OF_MEMORY`).
    OutOfMemory,
    /// The GPU runtime reported an error (`WKV_ERR_DEVICE`).
    Device,
    /// A file read or write failed (`WKV_ERR_IO`).
    Io,
    /// A file failed its checksum or structure checks (`WKV_ERR_CORRUPT`).
    Corrupt,
    /// A call out of order (`WKV_ERR_STATE`).
    State,
    /// A bug in wavekv (`WKV_ERR_INTERNAL`).
    Internal,
    /// A CUDA engine was asked for and no GPU is usable (`WKV_ERR_NO_DEVICE`).
    NoDevice,
    /// A status this binding does not know (a newer library).
    Unknown(i32),
}

impl Status {
    /// The status of a nonzero code; `None` for `WKV_OK`.
    pub fn from_code(code: i32) -> Option<Status> {
        Some(match code {
            sys::WKV_OK => return None,
            sys::WKV_ERR_INVALID_ARGUMENT => Status::InvalidArgument,
            sys::WKV_ERR_INVALID_HANDLE => Status::InvalidHandle,
            sys::WKV_ERR_OUT_OF_RANGE => Status::OutOfRange,
            sys::WKV_ERR_UNSUPPORTED => Status::Unsupported,
            sys::WKV_ERR_BUDGET => Status::Budget,
            sys::WKV_ERR_OUT_OF_MEMORY => Status::OutOfMemory,
            sys::WKV_ERR_DEVICE => Status::Device,
            sys::WKV_ERR_IO => Status::Io,
            sys::WKV_ERR_CORRUPT => Status::Corrupt,
            sys::WKV_ERR_STATE => Status::State,
            sys::WKV_ERR_INTERNAL => Status::Internal,
            sys::WKV_ERR_NO_DEVICE => Status::NoDevice,
            other => Status::Unknown(other),
        })
    }

    /// The C status code (`WKV_ERR_*`).
    pub fn code(self) -> i32 {
        match self {
            Status::InvalidArgument => sys::WKV_ERR_INVALID_ARGUMENT,
            Status::InvalidHandle => sys::WKV_ERR_INVALID_HANDLE,
            Status::OutOfRange => sys::WKV_ERR_OUT_OF_RANGE,
            Status::Unsupported => sys::WKV_ERR_UNSUPPORTED,
            Status::Budget => sys::WKV_ERR_BUDGET,
            Status::OutOfMemory => sys::WKV_ERR_OUT_OF_MEMORY,
            Status::Device => sys::WKV_ERR_DEVICE,
            Status::Io => sys::WKV_ERR_IO,
            Status::Corrupt => sys::WKV_ERR_CORRUPT,
            Status::State => sys::WKV_ERR_STATE,
            Status::Internal => sys::WKV_ERR_INTERNAL,
            Status::NoDevice => sys::WKV_ERR_NO_DEVICE,
            Status::Unknown(code) => code,
        }
    }

    /// The C name of the status (`"WKV_ERR_BUDGET"`), as `wkv_status_name`
    /// gives it.
    pub fn name(self) -> &'static str {
        match self {
            Status::InvalidArgument => "WKV_ERR_INVALID_ARGUMENT",
            Status::InvalidHandle => "WKV_ERR_INVALID_HANDLE",
            Status::OutOfRange => "WKV_ERR_OUT_OF_RANGE",
            Status::Unsupported => "WKV_ERR_UNSUPPORTED",
            Status::Budget => "WKV_ERR_BUDGET",
            Status::OutOfMemory => "WKV_ERR_OUT_OF_MEMORY",
            Status::Device => "WKV_ERR_DEVICE",
            Status::Io => "WKV_ERR_IO",
            Status::Corrupt => "WKV_ERR_CORRUPT",
            Status::State => "WKV_ERR_STATE",
            Status::Internal => "WKV_ERR_INTERNAL",
            Status::NoDevice => "WKV_ERR_NO_DEVICE",
            Status::Unknown(_) => "WKV_ERR_UNKNOWN",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Status::Unknown(code) => write!(f, "WKV_ERR_UNKNOWN({})", code),
            s => f.write_str(s.name()),
        }
    }
}

/// A failed call: its status and the message in words, from the library
/// (`wkv_last_error`, copied at once) or from this binding's own checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    status: Status,
    message: String,
}

impl Error {
    /// An error made by the binding (a closed handle, a slice of the wrong
    /// length), with the same statuses the library uses.
    pub fn new(status: Status, message: impl Into<String>) -> Error {
        Error {
            status,
            message: message.into(),
        }
    }

    /// What kind of failure this is.
    pub fn status(&self) -> Status {
        self.status
    }

    /// The message in words, naming the function that failed.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status, self.message)
    }
}

impl std::error::Error for Error {}

/// The result of every fallible call of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Turns a status code into a Result, copying the calling thread's message
/// before any other wavekv call can replace it.
pub(crate) fn check(rc: i32) -> Result<()> {
    let status = match Status::from_code(rc) {
        None => return Ok(()),
        Some(s) => s,
    };
    // SAFETY: wkv_last_error returns a NUL-terminated string owned by the
    // library, valid until the next wavekv call on this thread; it is copied
    // here, before any.
    let message = unsafe {
        let p = sys::wkv_last_error();
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    Err(Error { status, message })
}

/// An error found by the binding before calling in.
pub(crate) fn fail<T>(status: Status, message: String) -> Result<T> {
    Err(Error::new(status, message))
}
