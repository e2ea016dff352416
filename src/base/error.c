#include "apiary/error.h"

#include <errno.h>

const char *ap_version(void)
{
    return AP_VERSION_STRING;
}

const char *ap_strerror(int err)
{
    switch (err) {
    case 0:
        return "success";
#define AP__ERR_MSG(name, num, msg)                                                                \
    case AP_##name:                                                                                \
        return msg;
        AP_ERRNO_MAP(AP__ERR_MSG)
#undef AP__ERR_MSG
    default:
        return "unknown error";
    }
}

const char *ap_err_name(int err)
{
    switch (err) {
    case 0:
        return "OK";
#define AP__ERR_NAME(name, num, msg)                                                               \
    case AP_##name:                                                                                \
        return #name;
        AP_ERRNO_MAP(AP__ERR_NAME)
#undef AP__ERR_NAME
    default:
        return "UNKNOWN";
    }
}

int ap_err_from_errno(int neg_errno)
{
    switch (-neg_errno) {
    case 0:
        return 0;
    case ENOMEM:
        return AP_ENOMEM;
    case EINVAL:
        return AP_EINVAL;
    case ETIMEDOUT:
        return AP_ETIMEDOUT;
    case ECANCELED:
        return AP_ECANCELED;
    case ECONNREFUSED:
    case EHOSTUNREACH:
    case ENETUNREACH:
        return AP_EUNREACH;
    case ECONNRESET:
    case EPIPE:
        return AP_ECLOSED;
    case EAGAIN:
        return AP_EAGAIN;
    case EACCES:
    case EPERM:
        return AP_EPERM;
    case ENOENT:
        return AP_ENOTFOUND;
    case EEXIST:
        return AP_EEXIST;
    case EADDRINUSE:
    case EADDRNOTAVAIL:
        return AP_EADDR;
    case EMSGSIZE:
        return AP_EMSGSIZE;
    case EBUSY:
        return AP_EBUSY;
    case EIO:
        return AP_EIO;
    default:
        return AP_ESYS;
    }
}
